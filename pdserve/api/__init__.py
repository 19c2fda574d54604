"""The PDService API shared by the operator and the runtime: pydantic models, validation, CRD generation."""
