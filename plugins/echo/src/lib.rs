//! `echo`: returns the job's payload as its result.
//!
//! Grants: none; the component imports no khata interface. Payload: any JSON.
//! The result is the payload parsed and written back as JSON (equal as JSON;
//! whitespace and the order of object keys may differ from the text enqueued).

use khata_sdk::{Error, Job};
use serde_json::Value;

fn handle(job: Job) -> Result<Value, Error> {
    job.payload()
}

khata_sdk::handler!(handle);
