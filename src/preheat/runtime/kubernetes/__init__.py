"""Kubernetes mode: CRDs, manifests, the operator, the node agent and router discovery.

The CRDs (:mod:`.crds`), the InferenceEndpoint <-> endpoint spec conversion
(:mod:`.resources`) and every manifest (:mod:`.render`); the operator (:mod:`.operator`)
drives the shared reconcile loop through the Kubernetes executor (:mod:`.k8s_executor`),
whose object bodies are pure (:mod:`.workload`, :mod:`.conditions`,
:mod:`.endpoint_status`); the node agent (:mod:`.agent`); router discovery
(:mod:`.discovery`); pod start records (:mod:`.podrecords`). See docs/kubernetes.md.
"""
