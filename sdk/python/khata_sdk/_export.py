"""The component's export, used only inside a component: the build's entry
module imports the handler's module (which marks its function with
``@handler``) and then this class."""

from componentize_py_types import Err
from wit_world.imports.types import JobError_Fail, JobError_Retry

from . import _run as _handler
from .errors import Retry
from .job import Job

if _handler.registered() is None:
    raise RuntimeError(
        "the handler module marks no function with @khata_sdk.handler"
    )


class WitWorld:
    """``handle`` of the world ``handler``."""

    def handle(self, job) -> str:
        function = _handler.registered()
        delivery = Job(
            job.id,
            job.queue,
            job.payload,
            job.attempt,
            job.max_attempts,
            job.enqueued_at_ms,
        )
        try:
            return _handler.run(function, delivery)
        except Retry as e:
            raise Err(JobError_Retry(e.message)) from None
        except Exception as e:  # Fail, and anything `run` did not map
            raise Err(JobError_Fail(getattr(e, "message", str(e)))) from None
