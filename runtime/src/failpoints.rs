//! The crash and failure tests' failpoints, every one of them here: the
//! places where a test may pause the daemon (to `kill -9` it there), make a
//! step fail, or make a route panic. They are armed by the `FAILPOINTS`
//! environment variable (the `fail` crate's syntax) in builds with the
//! `failpoints` feature; without it each is nothing, and release builds
//! carry none.
//!
//! | name | used by | armed as |
//! | --- | --- | --- |
//! | `effect::after_started`, `effect::after_response` | `effects::fenced` | `1*return(<ms>)`: pause |
//! | `queue::before_finish`, `queue::before_interrupt` | `queue` | `1*return(<ms>)`: pause |
//! | `sqlite::commit` | `store::sqlite` | `return(<path>)`: every commit fails once `<path>` exists |
//! | `schedule::enqueue` | `schedule` | `return(<cause>)`: the store refuses the enqueue |
//! | `api::get_job` | `api` | `1*panic`: the route panics |

/// Keeps the failpoints armed from `FAILPOINTS` while it lives (the daemon
/// holds one for its whole run).
pub struct Scenario {
    #[cfg(feature = "failpoints")]
    _setup: fail::FailScenario<'static>,
}

/// Arms the failpoints `FAILPOINTS` names.
pub fn scenario() -> Scenario {
    Scenario {
        #[cfg(feature = "failpoints")]
        _setup: fail::FailScenario::setup(),
    }
}

/// The argument of the failpoint `name` when it is armed with
/// `return(<arg>)` (an empty one for a bare `return`); a `panic` action
/// panics here. `None` when it is not armed, and always without the
/// feature.
#[cfg(feature = "failpoints")]
pub fn armed(name: &str) -> Option<String> {
    fail::eval(name, |arg| arg.unwrap_or_default())
}

/// Without the `failpoints` feature no failpoint is ever armed.
#[cfg(not(feature = "failpoints"))]
pub fn armed(_name: &str) -> Option<String> {
    None
}

/// Waits at the failpoint `name` for the milliseconds it is armed with
/// (`return(<ms>)`), while the test kills the daemon.
pub async fn pause(name: &str) {
    if let Some(ms) = armed(name).and_then(|a| a.parse::<u64>().ok()) {
        tracing::warn!(failpoint = name, ms, "paused at a failpoint");
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}
