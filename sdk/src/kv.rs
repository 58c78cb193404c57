//! Key-value data in the queue's namespace.
//!
//! Keys are strings, values are bytes. Each call is one atomic step, and a
//! handler reads its own writes. Queues that share a namespace in `jobs.toml`
//! share their data. The queue needs the `kv` grant.
//!
//! Re-running these calls is safe in the at-least-once model: [`put`] and
//! [`delete`] leave the same state when repeated, and [`insert_if_absent`] is
//! the existence check that makes a step happen once:
//!
//! ```no_run
//! use khata_sdk::prelude::*;
//!
//! # fn handle(job: Job) -> Result<(), Error> {
//! if kv::insert_if_absent(format!("seen:{}", job.id()), b"1")? {
//!     // First time here for this job: do the step.
//! }
//! # Ok(()) }
//! ```
//!
//! The raw functions return [`EffectError`]; the `_json` helpers also
//! (de)serialize, so they return [`Error`]. `?` in a handler accepts both.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::khata::plugin::kv as wit;
use crate::{EffectError, Error};

/// The value at `key`, or `None` when there is none.
///
/// ```no_run
/// # use khata_sdk::{kv, Error};
/// # fn f() -> Result<(), Error> {
/// let count: u64 = match kv::get("order:count")? {
///     Some(bytes) => String::from_utf8_lossy(&bytes).parse().unwrap_or(0),
///     None => 0,
/// };
/// # Ok(()) }
/// ```
pub fn get(key: impl AsRef<str>) -> Result<Option<Vec<u8>>, EffectError> {
    wit::get(key.as_ref())
}

/// The value at `key` parsed as JSON into `T`, or `None` when there is none.
///
/// A value that does not parse is [`Error::Fail`].
///
/// ```no_run
/// # use khata_sdk::{kv, Error};
/// # fn f() -> Result<(), Error> {
/// let version: Option<u64> = kv::get_json("indexed:42")?;
/// # Ok(()) }
/// ```
pub fn get_json<T: DeserializeOwned>(key: impl AsRef<str>) -> Result<Option<T>, Error> {
    let key = key.as_ref();
    match wit::get(key)? {
        None => Ok(None),
        Some(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::fail(format!("kv value {key:?} is not the expected JSON: {e}"))),
    }
}

/// Sets `key` to `value`, replacing any value it had.
///
/// ```no_run
/// # use khata_sdk::{kv, Error};
/// # fn f() -> Result<(), Error> {
/// kv::put("greeting", "hello")?;
/// # Ok(()) }
/// ```
pub fn put(key: impl AsRef<str>, value: impl AsRef<[u8]>) -> Result<(), EffectError> {
    wit::put(key.as_ref(), value.as_ref())
}

/// Sets `key` to `value` encoded as JSON text.
///
/// ```no_run
/// # use khata_sdk::{kv, Error};
/// # fn f() -> Result<(), Error> {
/// kv::put_json("user:7", &serde_json::json!({ "name": "Ada" }))?;
/// # Ok(()) }
/// ```
pub fn put_json<T: Serialize + ?Sized>(key: impl AsRef<str>, value: &T) -> Result<(), Error> {
    let bytes = serde_json::to_vec(value)?;
    Ok(wit::put(key.as_ref(), &bytes)?)
}

/// Sets `key` to `value` only if it has no value: true when this call inserted
/// it, false when the key already existed (and its value is left alone).
///
/// ```no_run
/// # use khata_sdk::{kv, Error};
/// # fn f() -> Result<(), Error> {
/// let first_time = kv::insert_if_absent("welcomed:7", b"1")?;
/// # Ok(()) }
/// ```
pub fn insert_if_absent(
    key: impl AsRef<str>,
    value: impl AsRef<[u8]>,
) -> Result<bool, EffectError> {
    wit::insert_if_absent(key.as_ref(), value.as_ref())
}

/// Removes `key`: true when a value was deleted, false when there was none.
///
/// ```no_run
/// # use khata_sdk::{kv, Error};
/// # fn f() -> Result<(), Error> {
/// kv::delete("slot:3")?;
/// # Ok(()) }
/// ```
pub fn delete(key: impl AsRef<str>) -> Result<bool, EffectError> {
    wit::delete(key.as_ref())
}
