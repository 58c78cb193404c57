/*
 * echo_c: returns the job's payload as its result, the twin of the Rust
 * `echo`.
 *
 * Grants: none; the component imports no khata interface.
 * Payload: any JSON. The result is the payload's text as it was enqueued.
 */
#include "khata.h"

khata_outcome khata_handle(const khata_job *job) {
    return khata_ok_copy(job->payload);
}
