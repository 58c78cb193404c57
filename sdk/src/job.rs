//! One delivery of a job.

use serde::de::DeserializeOwned;

use crate::Error;
use crate::bindings;

/// One delivery of a job to this handler.
///
/// The [`id`](Job::id) is stable across every retry; the
/// [`attempt`](Job::attempt) number grows by one on each delivery, starting at 1.
#[derive(Debug, Clone)]
pub struct Job {
    id: String,
    queue: String,
    payload: String,
    attempt: u32,
    max_attempts: u32,
    enqueued_at_ms: u64,
}

impl Job {
    /// A job on its first attempt (of 1), for unit tests of handler logic.
    pub fn new(
        id: impl Into<String>,
        queue: impl Into<String>,
        payload: impl Into<String>,
    ) -> Self {
        Job {
            id: id.into(),
            queue: queue.into(),
            payload: payload.into(),
            attempt: 1,
            max_attempts: 1,
            enqueued_at_ms: 0,
        }
    }

    /// The same job at another attempt, for unit tests of retry logic.
    pub fn with_attempt(mut self, attempt: u32, max_attempts: u32) -> Self {
        self.attempt = attempt;
        self.max_attempts = max_attempts;
        self
    }

    /// The job's id, stable across every retry.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The queue the job was enqueued on.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// This delivery's number: 1 on the first.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// How many deliveries the job gets before it is dead-lettered.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// True when an [`Error::Retry`] from this attempt dead-letters the job.
    pub fn is_last_attempt(&self) -> bool {
        self.attempt >= self.max_attempts
    }

    /// When the job was enqueued, in milliseconds since the Unix epoch.
    pub fn enqueued_at_ms(&self) -> u64 {
        self.enqueued_at_ms
    }

    /// The payload as the JSON text that was enqueued.
    pub fn payload_text(&self) -> &str {
        &self.payload
    }

    /// The payload parsed into `T`.
    ///
    /// A payload that does not parse is [`Error::Fail`], with serde's message:
    /// the same payload will not parse better on the next attempt.
    ///
    /// ```no_run
    /// # use khata_sdk::{Error, Job};
    /// #[derive(serde::Deserialize)]
    /// struct Welcome { user_id: u64, email: String }
    ///
    /// # fn handle(job: Job) -> Result<(), Error> {
    /// let welcome: Welcome = job.payload()?;
    /// # Ok(()) }
    /// ```
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_str(&self.payload).map_err(|e| Error::fail(format!("bad payload: {e}")))
    }

    /// A job-scoped idempotency key, `<job-id>:<name>`: the same on every retry
    /// of this job, different for every job.
    ///
    /// ```no_run
    /// # use khata_sdk::{email, Error, Job};
    /// # fn handle(job: Job) -> Result<(), Error> {
    /// let message = email::Message::new("Your report", "See attached.").to("ops@example.com");
    /// email::send(job.key("report"), &message)?;
    /// # Ok(()) }
    /// ```
    pub fn key(&self, name: &str) -> String {
        format!("{}:{name}", self.id)
    }
}

impl From<bindings::Job> for Job {
    fn from(job: bindings::Job) -> Self {
        Job {
            id: job.id,
            queue: job.queue,
            payload: job.payload,
            attempt: job.attempt,
            max_attempts: job.max_attempts,
            enqueued_at_ms: job.enqueued_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_payload_fails_naming_the_serde_error() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct P {
            id: String,
        }
        let job = Job::new("j1", "q", r#"{"id": 5}"#);
        let err = job.payload::<P>().unwrap_err();
        assert!(!err.is_retry());
        assert!(
            err.message().starts_with("bad payload: invalid type"),
            "{err}"
        );
        assert_eq!(job.key("welcome"), "j1:welcome");
    }
}
