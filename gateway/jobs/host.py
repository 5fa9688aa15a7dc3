"""What batch jobs need of the gateway that serves them, and nothing more: its configuration
and metrics, whether its models are ready, and a served model by name. `GatewayState` is
one (structurally; create_app hands it in), so nothing here imports the gateway's state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

if TYPE_CHECKING:
    from batcher.metrics import Metrics
    from engine.base import EmbeddingEngine, GenerationEngine

    from ..config import ServerConfig
    from ..models.kinds import ModelKind
    from ..models.start import ServedModel
    from ..tenancy import Tenancy


class JobsHost(Protocol):
    @property
    def config(self) -> ServerConfig: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def tenancy(self) -> Tenancy:
        """Whose work a job's lines are: its creator key's tenant."""
        ...

    @property
    def ready(self) -> bool:
        """The models are loaded (lines run only then)."""
        ...

    @property
    def draining(self) -> bool: ...

    @property
    def load_error(self) -> str | None:
        """Why the models failed to load; None while they load or once they have."""
        ...

    # Jobs look a model up by its line's route, so always by a literal kind.
    @overload
    def model(self, name: str, kind: Literal["embedding"]) -> ServedModel[EmbeddingEngine]: ...
    @overload
    def model(self, name: str, kind: Literal["chat"]) -> ServedModel[GenerationEngine]: ...
    @overload
    def model(self, name: str, kind: Literal["custom"]) -> ServedModel[Any]: ...
    def model(self, name: str, kind: ModelKind) -> ServedModel[Any]:
        """The served model, or the APIError a direct request would get (404, 503)."""
        ...
