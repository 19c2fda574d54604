"""The pdserve operator: renders PDService objects into Kubernetes objects and reconciles them."""
