//! How a handler gives up on an attempt, and why an effect was not performed.

use std::fmt;

use crate::bindings::JobError;

/// Why the host did not perform an effect; returned by every effect function.
///
/// Each variant carries the host's explanation. `?` in a handler turns it into an
/// [`Error`]; see [`From<EffectError> for Error`](Error#impl-From<EffectError>-for-Error)
/// for which variants retry.
pub use crate::bindings::khata::plugin::types::EffectError;

/// How a handler gives up on this attempt.
///
/// `?` converts the errors a handler usually meets: [`EffectError`] (see its
/// `From` impl below for which ones retry) and [`serde_json::Error`] (always
/// [`Error::Fail`]: the same bytes will not parse better next time).
///
/// ```no_run
/// use khata_sdk::Error;
///
/// fn check(amount: i64) -> Result<(), Error> {
///     if amount <= 0 {
///         return Err(Error::fail(format!("amount must be positive, got {amount}")));
///     }
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Transient: the daemon backs off and delivers the job again, until its
    /// `max_attempts` are used up.
    Retry(String),
    /// Permanent: the job goes to the dead-letter queue now.
    Fail(String),
}

impl Error {
    /// A transient error: back off and retry.
    pub fn retry(message: impl Into<String>) -> Self {
        Error::Retry(message.into())
    }

    /// A permanent error: dead-letter the job now.
    pub fn fail(message: impl Into<String>) -> Self {
        Error::Fail(message.into())
    }

    /// True for [`Error::Retry`].
    pub fn is_retry(&self) -> bool {
        matches!(self, Error::Retry(_))
    }

    /// The explanation, as the daemon records it on the attempt.
    pub fn message(&self) -> &str {
        match self {
            Error::Retry(message) | Error::Fail(message) => message,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_retry() { "retry" } else { "fail" };
        write!(f, "{kind}: {}", self.message())
    }
}

impl std::error::Error for Error {}

/// An effect error becomes [`Error::Retry`] when another attempt can succeed and
/// [`Error::Fail`] when it cannot:
///
/// | effect error | becomes | because |
/// | --- | --- | --- |
/// | `in-progress` | Retry | a live attempt holds the fence; it will finish or die |
/// | `transient` | Retry | the provider failed in a way that is safe to retry |
/// | `fenced` | Retry | this attempt lost its lease; the daemon ignores its outcome, and the job's current attempt carries on |
/// | `denied` | Fail | the queue lacks the grant; only a change to `jobs.toml` helps |
/// | `key-reused` | Fail | the key names another request; a bug in the handler's keys |
/// | `rejected` | Fail | the provider refused; retrying won't help |
/// | `invalid` | Fail | the request itself is malformed |
/// | `uncertain` | Fail | an earlier try may or may not have happened and the policy is at most once; a retry would meet the same fence, so a person decides |
///
/// Match on the [`EffectError`] yourself where a handler knows better, for
/// example to carry on after `uncertain`.
impl From<EffectError> for Error {
    fn from(error: EffectError) -> Self {
        let kind = error.kind();
        let message = format!("effect {kind}: {}", error.message());
        if error.is_retryable() {
            Error::Retry(message)
        } else {
            Error::Fail(message)
        }
    }
}

/// A JSON error is permanent: [`Error::Fail`].
impl From<serde_json::Error> for Error {
    fn from(error: serde_json::Error) -> Self {
        Error::Fail(format!("JSON: {error}"))
    }
}

impl From<Error> for JobError {
    fn from(error: Error) -> Self {
        match error {
            Error::Retry(message) => JobError::Retry(message),
            Error::Fail(message) => JobError::Fail(message),
        }
    }
}

impl EffectError {
    /// The WIT name of the variant, such as `"key-reused"`.
    pub fn kind(&self) -> &'static str {
        match self {
            EffectError::Denied(_) => "denied",
            EffectError::KeyReused(_) => "key-reused",
            EffectError::InProgress(_) => "in-progress",
            EffectError::Fenced(_) => "fenced",
            EffectError::Uncertain(_) => "uncertain",
            EffectError::Transient(_) => "transient",
            EffectError::Rejected(_) => "rejected",
            EffectError::Invalid(_) => "invalid",
        }
    }

    /// The host's explanation.
    pub fn message(&self) -> &str {
        match self {
            EffectError::Denied(message)
            | EffectError::KeyReused(message)
            | EffectError::InProgress(message)
            | EffectError::Fenced(message)
            | EffectError::Uncertain(message)
            | EffectError::Transient(message)
            | EffectError::Rejected(message)
            | EffectError::Invalid(message) => message,
        }
    }

    /// True when a later attempt may succeed: `in-progress`, `transient` and
    /// `fenced`. This is the rule `?` applies when converting into [`Error`].
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            EffectError::InProgress(_) | EffectError::Transient(_) | EffectError::Fenced(_)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effect_errors_retry_only_when_another_attempt_can_succeed() {
        let retry = [
            EffectError::InProgress("x".into()),
            EffectError::Transient("x".into()),
            EffectError::Fenced("x".into()),
        ];
        for e in retry {
            assert!(Error::from(e).is_retry());
        }
        let fail = [
            EffectError::Denied("x".into()),
            EffectError::KeyReused("x".into()),
            EffectError::Rejected("x".into()),
            EffectError::Invalid("x".into()),
            EffectError::Uncertain("x".into()),
        ];
        for e in fail {
            assert!(!Error::from(e).is_retry());
        }
        assert_eq!(
            Error::from(EffectError::Denied("kv is not granted".into())).message(),
            "effect denied: kv is not granted"
        );
    }
}
