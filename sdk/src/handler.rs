//! Exporting a handler function as the component's `handle`.

use serde::Serialize;

use crate::bindings::{self, JobError};
use crate::{Error, Job};

/// Exports a handler function as this component's `handle`.
///
/// The function takes a [`Job`](crate::Job) and returns
/// `Result<T, khata_sdk::Error>` for any `T: Serialize`; the `Ok` value becomes
/// the job's JSON result. Use it once per plugin crate (a `cdylib`):
///
/// ```no_run
/// use khata_sdk::prelude::*;
///
/// fn handle(job: Job) -> Result<serde_json::Value, Error> {
///     job.payload()
/// }
///
/// khata_sdk::handler!(handle);
/// ```
#[macro_export]
macro_rules! handler {
    ($handler:expr $(,)?) => {
        #[doc(hidden)]
        struct __KhataHandler;

        impl $crate::bindings::Guest for __KhataHandler {
            fn handle(
                job: $crate::bindings::Job,
            ) -> ::core::result::Result<::std::string::String, $crate::bindings::JobError> {
                $crate::__run(job, $handler)
            }
        }

        $crate::bindings::export!(__KhataHandler with_types_in $crate::bindings);
    };
}

/// Runs `handler` on one delivery and encodes its outcome for the host: the
/// `Ok` value as JSON text, an [`Error`] as the WIT `job-error`.
pub fn run<T, F>(job: bindings::Job, handler: F) -> Result<String, JobError>
where
    T: Serialize,
    F: FnOnce(Job) -> Result<T, Error>,
{
    let value = handler(Job::from(job))?;
    serde_json::to_string(&value)
        .map_err(|e| JobError::Fail(format!("the result is not JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(payload: &str) -> bindings::Job {
        bindings::Job {
            id: "j".into(),
            queue: "q".into(),
            payload: payload.into(),
            attempt: 2,
            max_attempts: 5,
            enqueued_at_ms: 7,
        }
    }

    #[test]
    fn results_become_json_text_and_errors_job_errors() {
        let ok = run(job(r#"{"a":1}"#), |j| j.payload::<serde_json::Value>());
        assert_eq!(ok.unwrap(), r#"{"a":1}"#);
        let attempt = run(job("{}"), |j| Ok(j.attempt()));
        assert_eq!(attempt.unwrap(), "2");
        let retry = run(job("{}"), |_| Err::<(), _>(Error::retry("later")));
        assert!(matches!(retry, Err(JobError::Retry(m)) if m == "later"));
        let fail = run(job("nope"), |j| j.payload::<serde_json::Value>());
        assert!(matches!(fail, Err(JobError::Fail(m)) if m.starts_with("bad payload")));
    }
}
