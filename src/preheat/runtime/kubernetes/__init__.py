"""Kubernetes mode: CRDs, manifests and the InferenceEndpoint <-> endpoint spec conversion.

What exists now (docs/kubernetes.md): the CRDs (:mod:`.crds`), the conversion
(:mod:`.resources`) and every manifest (:mod:`.render`). The operator, the node agent and
router discovery will implement the shared reconcile loop's executor protocol here.
"""
