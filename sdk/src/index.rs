//! Versioned documents in named collections of the daemon's embedded index.
//!
//! A document is JSON text stored under an id in a collection, with a version
//! chosen by the handler, for example the source row's `updated_at` in
//! milliseconds. An upsert with a lower version than the stored one is ignored
//! as [`UpsertOutcome::Stale`], an equal one is [`UpsertOutcome::Unchanged`], so
//! re-running an upsert is always safe, and late deliveries cannot overwrite
//! newer data. Collections are readable through the daemon's API. The queue
//! needs the `index` grant for the collection.
//!
//! The raw functions return [`EffectError`]; the `_json` helpers also
//! (de)serialize, so they return [`Error`]. `?` in a handler accepts both.

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Serialize, Serializer};

use crate::bindings::khata::plugin::index as wit;
use crate::{EffectError, Error};

/// What an [`upsert`] did.
///
/// Serializes as its lower-case WIT name (`"inserted"`, …), as does `Display`.
pub use crate::bindings::khata::plugin::index::UpsertOutcome;

/// Stores `document` (JSON text) as `id` in `collection` at `version`, unless
/// a version at least as new is stored already.
///
/// ```no_run
/// # use khata_sdk::{index, Error};
/// # fn f() -> Result<(), Error> {
/// let doc = r#"{"id":"p1","name":"Tea","price":3.5,"updated_at_ms":1700000000000}"#;
/// let outcome = index::upsert("products", "p1", doc, 1_700_000_000_000)?;
/// # Ok(()) }
/// ```
pub fn upsert(
    collection: &str,
    id: &str,
    document: &str,
    version: u64,
) -> Result<UpsertOutcome, EffectError> {
    wit::upsert(collection, id, document, version)
}

/// [`upsert`] with the document serialized as JSON.
///
/// ```no_run
/// # use khata_sdk::{index, Error};
/// # fn f() -> Result<(), Error> {
/// let doc = serde_json::json!({ "id": "p1", "name": "Tea" });
/// let outcome = index::upsert_json("products", "p1", &doc, 1_700_000_000_000)?;
/// # Ok(()) }
/// ```
pub fn upsert_json<T: Serialize + ?Sized>(
    collection: &str,
    id: &str,
    document: &T,
    version: u64,
) -> Result<UpsertOutcome, Error> {
    let document = serde_json::to_string(document)?;
    Ok(wit::upsert(collection, id, &document, version)?)
}

/// Removes `id` from `collection` unless a newer version than `version` is
/// stored: true when a document was removed.
///
/// ```no_run
/// # use khata_sdk::{index, Error};
/// # fn f() -> Result<(), Error> {
/// index::remove("products", "p1", 1_700_000_000_001)?;
/// # Ok(()) }
/// ```
pub fn remove(collection: &str, id: &str, version: u64) -> Result<bool, EffectError> {
    wit::remove(collection, id, version)
}

/// The document stored as `id` in `collection`, as JSON text.
///
/// ```no_run
/// # use khata_sdk::{index, Error};
/// # fn f() -> Result<(), Error> {
/// let doc: Option<String> = index::get("products", "p1")?;
/// # Ok(()) }
/// ```
pub fn get(collection: &str, id: &str) -> Result<Option<String>, EffectError> {
    wit::get(collection, id)
}

/// The document stored as `id` in `collection`, parsed into `T`.
///
/// A document that does not parse is [`Error::Fail`].
pub fn get_json<T: DeserializeOwned>(collection: &str, id: &str) -> Result<Option<T>, Error> {
    match wit::get(collection, id)? {
        None => Ok(None),
        Some(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::fail(format!("{collection}/{id} is not the expected JSON: {e}"))),
    }
}

impl UpsertOutcome {
    /// The WIT name: `"inserted"`, `"updated"`, `"unchanged"` or `"stale"`.
    pub fn as_str(self) -> &'static str {
        match self {
            UpsertOutcome::Inserted => "inserted",
            UpsertOutcome::Updated => "updated",
            UpsertOutcome::Unchanged => "unchanged",
            UpsertOutcome::Stale => "stale",
        }
    }

    /// True when the stored document changed: inserted or updated.
    pub fn changed(self) -> bool {
        matches!(self, UpsertOutcome::Inserted | UpsertOutcome::Updated)
    }
}

impl fmt::Display for UpsertOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for UpsertOutcome {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_serialize_as_their_wit_names() {
        let json = serde_json::to_string(&[UpsertOutcome::Inserted, UpsertOutcome::Stale]).unwrap();
        assert_eq!(json, r#"["inserted","stale"]"#);
        assert_eq!(UpsertOutcome::Unchanged.to_string(), "unchanged");
    }
}
