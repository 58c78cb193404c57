//! What a handler may do to the world, and the checks on every call.
//!
//! An [`Effects`] value belongs to one attempt. Every call is checked, in
//! this order, before anything happens:
//!
//! 1. the queue's grants (DESIGN 5): a call without a grant is `denied`;
//! 2. the request's shape (sizes, names): a malformed one is `invalid`;
//! 3. the attempt's lease, inside the same store step as the effect: an
//!    attempt that no longer holds its job is `fenced` and changes nothing.
//!
//! The embedded effects (kv, index) are single store steps, idempotent by
//! nature, and need no fence of their own. Email and HTTP, the external
//! effects with fences and providers, are not granted by this build: their
//! calls are `denied` with a message that says so.
//!
//! This module knows nothing of wasmtime: the host maps its types to the WIT.

use std::sync::Arc;

use crate::config::Grants;
use crate::job::{LeaseRef, Millis};
use crate::store::{Store, StoreError, UpsertOutcome};

/// Largest kv key or index id, in bytes.
pub const MAX_KEY: usize = 1024;
/// Largest kv value or index document, in bytes.
pub const MAX_VALUE: usize = 1 << 20;

/// Why an effect was not performed; mirrors the WIT `effect-error`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EffectError {
    #[error("denied: {0}")]
    Denied(String),
    #[error("key reused: {0}")]
    KeyReused(String),
    #[error("in progress: {0}")]
    InProgress(String),
    #[error("fenced: {0}")]
    Fenced(String),
    #[error("uncertain: {0}")]
    Uncertain(String),
    #[error("transient: {0}")]
    Transient(String),
    #[error("rejected: {0}")]
    Rejected(String),
    #[error("invalid: {0}")]
    Invalid(String),
}

impl From<StoreError> for EffectError {
    fn from(e: StoreError) -> EffectError {
        match e {
            StoreError::Fenced { .. } => EffectError::Fenced(e.to_string()),
            StoreError::Unavailable(_) => EffectError::Transient(e.to_string()),
            other => EffectError::Invalid(other.to_string()),
        }
    }
}

/// The effects of one attempt.
pub struct Effects {
    store: Arc<dyn Store>,
    queue: String,
    namespace: String,
    grants: Arc<Grants>,
    lease: LeaseRef,
}

impl std::fmt::Debug for Effects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Effects")
            .field("queue", &self.queue)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

fn check_key(what: &str, key: &str) -> Result<(), EffectError> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(EffectError::Invalid(format!(
            "{what} must be 1 to {MAX_KEY} bytes, got {}",
            key.len()
        )));
    }
    Ok(())
}

fn check_value(what: &str, len: usize) -> Result<(), EffectError> {
    if len > MAX_VALUE {
        return Err(EffectError::Invalid(format!(
            "{what} is {len} bytes, more than the {MAX_VALUE} allowed"
        )));
    }
    Ok(())
}

impl Effects {
    pub fn new(
        store: Arc<dyn Store>,
        queue: String,
        namespace: String,
        grants: Arc<Grants>,
        lease: LeaseRef,
    ) -> Effects {
        Effects {
            store,
            queue,
            namespace,
            grants,
            lease,
        }
    }

    pub fn lease(&self) -> &LeaseRef {
        &self.lease
    }

    fn kv_granted(&self) -> Result<(), EffectError> {
        if self.grants.kv {
            Ok(())
        } else {
            Err(EffectError::Denied(format!(
                "queue {:?} is not granted kv (grants = {{ kv = true }})",
                self.queue
            )))
        }
    }

    fn index_granted(&self, collection: &str) -> Result<(), EffectError> {
        if self.grants.index.iter().any(|c| c == collection) {
            Ok(())
        } else {
            Err(EffectError::Denied(format!(
                "queue {:?} is not granted index collection {collection:?} (grants = {{ index = [{collection:?}] }})",
                self.queue
            )))
        }
    }

    pub async fn kv_get(&self, key: &str) -> Result<Option<Vec<u8>>, EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        Ok(self.store.kv_get(&self.lease, &self.namespace, key).await?)
    }

    pub async fn kv_put(&self, key: &str, value: Vec<u8>) -> Result<(), EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        check_value("a kv value", value.len())?;
        Ok(self
            .store
            .kv_put(&self.lease, &self.namespace, key, value)
            .await?)
    }

    pub async fn kv_insert_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
    ) -> Result<bool, EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        check_value("a kv value", value.len())?;
        Ok(self
            .store
            .kv_insert_if_absent(&self.lease, &self.namespace, key, value)
            .await?)
    }

    pub async fn kv_delete(&self, key: &str) -> Result<bool, EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        Ok(self
            .store
            .kv_delete(&self.lease, &self.namespace, key)
            .await?)
    }

    pub async fn index_upsert(
        &self,
        collection: &str,
        id: &str,
        document: &str,
        version: u64,
    ) -> Result<UpsertOutcome, EffectError> {
        self.index_granted(collection)?;
        check_key("a document id", id)?;
        check_value("a document", document.len())?;
        Ok(self
            .store
            .index_upsert(
                &self.lease,
                collection,
                id,
                document,
                version,
                Millis::now(),
            )
            .await?)
    }

    pub async fn index_remove(
        &self,
        collection: &str,
        id: &str,
        version: u64,
    ) -> Result<bool, EffectError> {
        self.index_granted(collection)?;
        check_key("a document id", id)?;
        Ok(self
            .store
            .index_remove(&self.lease, collection, id, version, Millis::now())
            .await?)
    }

    pub async fn index_get(
        &self,
        collection: &str,
        id: &str,
    ) -> Result<Option<String>, EffectError> {
        self.index_granted(collection)?;
        check_key("a document id", id)?;
        Ok(self
            .store
            .index_get_leased(&self.lease, collection, id)
            .await?)
    }

    /// Email is an external effect; its provider comes with the effects broker.
    pub fn email_denied(&self) -> EffectError {
        EffectError::Denied(format!(
            "queue {:?}: email is not available in this build of khata",
            self.queue
        ))
    }

    /// HTTP is an external effect; its providers come with the effects broker.
    pub fn http_denied(&self, provider: &str) -> EffectError {
        EffectError::Denied(format!(
            "queue {:?}: http provider {provider:?} is not available in this build of khata",
            self.queue
        ))
    }
}
