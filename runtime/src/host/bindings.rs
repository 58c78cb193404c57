//! The generated bindings of `wit/khata.wit` and their host side: each
//! import forwards to [`Effects`](crate::effects::Effects), which checks
//! grants and fences.

use crate::effects::EffectError as Refused;
use crate::effects::email::Mail;
use crate::effects::http::HttpRequest;
use crate::store::UpsertOutcome;

use super::AttemptState;

wasmtime::component::bindgen!({
    world: "handler",
    path: "../wit",
    imports: { default: async },
    exports: { default: async },
});

use khata::plugin::{email, http, index, kv, log, types};

/// A khata interface a plugin may import; each needs a grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Capability {
    Kv,
    Index,
    Email,
    Http,
    Log,
}

impl Capability {
    /// The capability behind an import name such as `khata:plugin/kv@0.1.0`;
    /// `None` for WASI and for `types`.
    pub fn from_import(name: &str) -> Option<Capability> {
        let iface = name.strip_prefix("khata:plugin/")?;
        let iface = iface.split('@').next().unwrap_or(iface);
        match iface {
            "kv" => Some(Capability::Kv),
            "index" => Some(Capability::Index),
            "email" => Some(Capability::Email),
            "http" => Some(Capability::Http),
            "log" => Some(Capability::Log),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Kv => "kv",
            Capability::Index => "index",
            Capability::Email => "email",
            Capability::Http => "http",
            Capability::Log => "log",
        }
    }

    /// The WIT interface name, for error messages.
    pub fn interface(self) -> String {
        format!("khata:plugin/{}", self.as_str())
    }
}

impl From<Refused> for types::EffectError {
    fn from(e: Refused) -> types::EffectError {
        use types::EffectError as W;
        match e {
            Refused::Denied(m) => W::Denied(m),
            Refused::KeyReused(m) => W::KeyReused(m),
            Refused::InProgress(m) => W::InProgress(m),
            Refused::Fenced(m) => W::Fenced(m),
            Refused::Uncertain(m) => W::Uncertain(m),
            Refused::Transient(m) => W::Transient(m),
            Refused::Rejected(m) => W::Rejected(m),
            Refused::Invalid(m) => W::Invalid(m),
        }
    }
}

impl types::Host for AttemptState {}

impl kv::Host for AttemptState {
    async fn get(&mut self, key: String) -> Result<Option<Vec<u8>>, types::EffectError> {
        Ok(self.effects.kv_get(&key).await?)
    }

    async fn put(&mut self, key: String, value: Vec<u8>) -> Result<(), types::EffectError> {
        Ok(self.effects.kv_put(&key, value).await?)
    }

    async fn insert_if_absent(
        &mut self,
        key: String,
        value: Vec<u8>,
    ) -> Result<bool, types::EffectError> {
        Ok(self.effects.kv_insert_if_absent(&key, value).await?)
    }

    async fn delete(&mut self, key: String) -> Result<bool, types::EffectError> {
        Ok(self.effects.kv_delete(&key).await?)
    }
}

impl index::Host for AttemptState {
    async fn upsert(
        &mut self,
        collection: String,
        id: String,
        document: String,
        version: u64,
    ) -> Result<index::UpsertOutcome, types::EffectError> {
        let outcome = self
            .effects
            .index_upsert(&collection, &id, &document, version)
            .await?;
        Ok(match outcome {
            UpsertOutcome::Inserted => index::UpsertOutcome::Inserted,
            UpsertOutcome::Updated => index::UpsertOutcome::Updated,
            UpsertOutcome::Unchanged => index::UpsertOutcome::Unchanged,
            UpsertOutcome::Stale => index::UpsertOutcome::Stale,
        })
    }

    async fn remove(
        &mut self,
        collection: String,
        id: String,
        version: u64,
    ) -> Result<bool, types::EffectError> {
        Ok(self.effects.index_remove(&collection, &id, version).await?)
    }

    async fn get(
        &mut self,
        collection: String,
        id: String,
    ) -> Result<Option<String>, types::EffectError> {
        Ok(self.effects.index_get(&collection, &id).await?)
    }
}

impl email::Host for AttemptState {
    async fn send(
        &mut self,
        key: String,
        message: email::Message,
    ) -> Result<email::Receipt, types::EffectError> {
        let mail = Mail {
            to: message.to,
            cc: message.cc,
            from: message.from,
            subject: message.subject,
            text: message.text,
            html: message.html,
        };
        let (message_id, replayed) = self.effects.email_send(&key, mail).await?;
        Ok(email::Receipt {
            message_id,
            replayed,
        })
    }
}

impl http::Host for AttemptState {
    async fn send(
        &mut self,
        key: String,
        request: http::Request,
    ) -> Result<http::Response, types::EffectError> {
        let req = HttpRequest {
            method: request.method,
            path: request.path,
            headers: request.headers,
            body: request.body,
        };
        let (response, replayed) = self.effects.http_send(&key, &request.provider, req).await?;
        Ok(http::Response {
            status: response.status,
            headers: response.headers,
            body: response.body,
            replayed,
        })
    }
}

impl log::Host for AttemptState {
    async fn log(&mut self, level: log::Level, message: String) {
        let budget = &mut self.log;
        if budget.left == 0 || budget.lines_left == 0 {
            budget.dropped_messages += 1;
            budget.dropped_bytes += message.len() as u64;
            if !budget.truncated {
                budget.truncated = true;
                tracing::warn!(
                    job = %budget.job_id, queue = %budget.queue, attempt = budget.attempt,
                    "log output of this attempt truncated: over the per-attempt budget; the rest is counted, not logged"
                );
            }
            return;
        }
        budget.lines_left -= 1;
        let message = if message.len() > budget.left {
            let mut end = budget.left;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            budget.dropped_bytes += (message.len() - end) as u64;
            format!("{}…", &message[..end])
        } else {
            message
        };
        budget.left = budget.left.saturating_sub(message.len());
        let (job, queue, attempt, version) = (
            &budget.job_id,
            &budget.queue,
            budget.attempt,
            &budget.version[..12.min(budget.version.len())],
        );
        match level {
            log::Level::Trace => {
                tracing::trace!(target: "khata::guest", job, queue, attempt, version, "{message}")
            }
            log::Level::Debug => {
                tracing::debug!(target: "khata::guest", job, queue, attempt, version, "{message}")
            }
            log::Level::Info => {
                tracing::info!(target: "khata::guest", job, queue, attempt, version, "{message}")
            }
            log::Level::Warn => {
                tracing::warn!(target: "khata::guest", job, queue, attempt, version, "{message}")
            }
            log::Level::Error => {
                tracing::error!(target: "khata::guest", job, queue, attempt, version, "{message}")
            }
        }
    }
}
