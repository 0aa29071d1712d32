"""The base of every config section model: frozen, unknown keys refused, attribute docstrings read.

    python -c "from tasks.core.config.base import Frozen; print(Frozen.model_config)"

Its own module so that every section (the run schema, the tracking section, a launch backend's
settings) derives from the one definition without importing the schema that assembles them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
