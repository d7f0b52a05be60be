"""``gds-check``'s published JSON schema, checked."""
from __future__ import annotations

__all__ = ["schema_violations"]


def schema_violations(doc: object) -> list[str]:
    """Where ``doc`` breaks ``gds-check``'s published JSON schema (jsonschema, draft 2020-12); empty when it holds."""
    import jsonschema  # a test extra: imported where it is used

    from gds_offload.check.report import JSON_SCHEMA

    validator = jsonschema.Draft202012Validator(JSON_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path)) or '$'}: {e.message}" for e in validator.iter_errors(doc)]
