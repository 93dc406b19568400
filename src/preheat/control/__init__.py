"""The controller: endpoint spec, pure planner, placement, rollout."""
