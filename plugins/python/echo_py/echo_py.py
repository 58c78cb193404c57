"""``echo`` in Python: returns its payload as the result. The twin of the
Rust ``plugins/echo``; it needs no grant. The benchmark's measure of what
the language costs on its own (figure 9)."""

from khata_sdk import Job, handler


@handler
def handle(job: Job):
    return job.payload()
