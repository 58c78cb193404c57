//! The fence protocol for external effects (docs/fences.md), the same for every
//! provider.
//!
//! Per call, with the fence of (namespace, kind, key) and the fingerprint of
//! the canonical request:
//!
//! | the fence is | the host |
//! | --- | --- |
//! | absent | writes `started` (durably), performs, writes `done` with the result (durably), returns it |
//! | `done`, same fingerprint | returns the recorded result, `replayed`, performs nothing |
//! | `done` or held, other fingerprint | `key-reused` |
//! | `started` by a live attempt | `in-progress` |
//! | `started` by an attempt whose call is over (crash, timeout, cancel, or an unknown outcome) | [`Fenced::resolve_unknown`] |
//! | `uncertain` | `uncertain`, until an operator resolves it |
//!
//! An unknown outcome is resolved by asking the provider first
//! (reconciliation), then by its nature: an idempotent provider is asked
//! again with the same key; a non-idempotent one follows the queue's
//! `on_uncertain` policy.
//!
//! Under `khata verify` ([`super::recorded`]) a call shows its watch the
//! steps: before `fence_begin`, after the provider answered and before
//! `fence_done`, and after `fence_done`; the watch may stop the attempt at
//! any of them. Unwatched, the steps are nothing. The provider itself is
//! behind [`super::outside`]'s traits, so the protocol is the same whether
//! it reaches the world or a recorder.

use std::future::Future;

use sha2::{Digest, Sha256};

use super::recorded::Point;
use super::{EffectError, Effects};
use crate::config::OnUncertain;
use crate::failpoints;

use crate::store::{FenceBegin, FenceId, StoreError};

/// Most times one call performs an effect whose outcomes stay unknown.
const MAX_PERFORMS: u32 = 3;

/// How one try of an external effect ended.
#[derive(Debug)]
pub enum Tried {
    /// It happened; this is its result, to record and replay.
    Done(Vec<u8>),
    /// It certainly did not happen and may be tried again (nothing left the
    /// host, or the provider said "not now").
    NotSent(String),
    /// It certainly did not happen and retrying will not help.
    Rejected(String),
    /// The request is malformed; nothing was sent.
    Invalid(String),
    /// It may or may not have happened.
    Unknown(String),
}

/// What asking the provider about a key found.
#[derive(Debug)]
pub enum Reconciled {
    /// The effect happened; this is its result.
    Happened(Vec<u8>),
    /// It did not happen.
    NotHappened,
    /// The provider cannot tell, or could not be asked.
    Unknown,
}

/// One external effect as the protocol sees it: a provider, a request and
/// its nature.
pub trait Effect {
    fn kind(&self) -> &'static str;
    /// The canonical request, for the fingerprint.
    fn canonical(&self) -> Vec<u8>;
    /// Whether the provider drops a repeat of the same key by itself.
    fn idempotent(&self) -> bool;
    fn perform(&self, fencing_token: u64) -> impl Future<Output = Tried> + Send;
    fn reconcile(&self, fencing_token: u64) -> impl Future<Output = Reconciled> + Send;
}

/// The answer of a fenced call: the recorded result and whether it was
/// replayed rather than performed now.
#[derive(Debug, PartialEq)]
pub struct Answer {
    pub result: Vec<u8>,
    pub replayed: bool,
}

pub(crate) fn fingerprint(kind: &str, canonical: &[u8]) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(kind.as_bytes());
    h.update([0]);
    h.update(canonical);
    h.finalize().to_vec()
}

fn store_error(e: StoreError) -> EffectError {
    e.into()
}

/// Drives one fenced call.
pub struct Fenced<'a, E> {
    effects: &'a Effects,
    effect: &'a E,
    id: FenceId,
    fingerprint: Vec<u8>,
}

impl<'a, E: Effect + Sync> Fenced<'a, E> {
    pub fn new(effects: &'a Effects, effect: &'a E, key: &str) -> Fenced<'a, E> {
        Fenced {
            id: FenceId {
                namespace: effects.namespace.clone(),
                kind: effect.kind().to_owned(),
                key: key.to_owned(),
            },
            fingerprint: fingerprint(effect.kind(), &effect.canonical()),
            effects,
            effect,
        }
    }

    async fn step(&self, point: Point) {
        self.effects
            .step(&self.id.kind, &self.id.key, &self.fingerprint, point)
            .await;
    }

    async fn record(&self, outcome: &str) {
        self.effects
            .record(&self.id.kind, &self.id.key, outcome)
            .await;
    }

    async fn refuse(&self, e: EffectError) -> Result<Answer, EffectError> {
        Err(self.effects.refused(&self.id.kind, &self.id.key, e).await)
    }

    fn name(&self) -> String {
        format!("{}/{}/{}", self.id.namespace, self.id.kind, self.id.key)
    }

    /// Runs the call through the table of docs/fences.md#what-fence_begin-does.
    pub async fn call(&self) -> Result<Answer, EffectError> {
        let fx = self.effects;
        self.step(Point::BeforeStarted).await;
        let begun = fx
            .store
            .fence_begin(&fx.lease, &self.id, &self.fingerprint, fx.now())
            .await
            .map_err(store_error);
        match begun {
            Err(e) => self.refuse(e).await,
            Ok(FenceBegin::Started) => self.perform(1).await,
            Ok(FenceBegin::Replay(result)) => {
                self.record("replayed").await;
                Ok(Answer {
                    result,
                    replayed: true,
                })
            }
            Ok(FenceBegin::KeyReused) => {
                let msg = format!(
                    "key {:?} was used before for another {} request; an effect's key must name that one effect",
                    self.id.key, self.id.kind
                );
                self.refuse(EffectError::KeyReused(msg)).await
            }
            Ok(FenceBegin::InProgress { job_id }) => {
                let msg = format!(
                    "fence {} is held by a running attempt of job {job_id:?}",
                    self.name()
                );
                self.refuse(EffectError::InProgress(msg)).await
            }
            Ok(FenceBegin::Uncertain(_)) => self.refuse(self.uncertain_error()).await,
            Ok(FenceBegin::Abandoned(_)) => self.resolve_unknown(0).await,
        }
    }

    fn uncertain_error(&self) -> EffectError {
        EffectError::Uncertain(format!(
            "whether {} happened is unknown; an operator resolves it with `khata fence resolve {} {} {} done|not-done`",
            self.name(),
            self.id.namespace,
            self.id.kind,
            self.id.key
        ))
    }

    /// Performs the effect under a fence this attempt holds.
    async fn perform(&self, performs: u32) -> Result<Answer, EffectError> {
        let fx = self.effects;
        failpoints::pause("effect::after_started").await;
        let tried = self.effect.perform(fx.lease.token).await;
        failpoints::pause("effect::after_response").await;
        match tried {
            Tried::Done(result) => {
                self.step(Point::Started).await;
                fx.store
                    .fence_done(&fx.lease, &self.id, result.clone(), fx.now())
                    .await
                    .map_err(store_error)?;
                self.record("performed").await;
                self.step(Point::Done).await;
                Ok(Answer {
                    result,
                    replayed: false,
                })
            }
            Tried::NotSent(msg) => {
                self.release().await?;
                self.refuse(EffectError::Transient(msg)).await
            }
            Tried::Rejected(msg) => {
                self.release().await?;
                self.refuse(EffectError::Rejected(msg)).await
            }
            Tried::Invalid(msg) => {
                self.release().await?;
                self.refuse(EffectError::Invalid(msg)).await
            }
            Tried::Unknown(msg) => {
                tracing::warn!(fence = %self.name(), error = %msg, "the outcome of an effect is unknown");
                self.resolve_unknown(performs).await
            }
        }
    }

    async fn release(&self) -> Result<(), EffectError> {
        let fx = self.effects;
        fx.store
            .fence_release(&fx.lease, &self.id)
            .await
            .map_err(store_error)
    }

    /// The fence is `started` and nobody is performing the effect: ask the
    /// provider, then decide by its nature and the queue's policy.
    async fn resolve_unknown(&self, performs: u32) -> Result<Answer, EffectError> {
        let fx = self.effects;
        let now = fx.now();
        match self.effect.reconcile(fx.lease.token).await {
            Reconciled::Happened(result) => {
                fx.store
                    .fence_take_over(&fx.lease, &self.id, now)
                    .await
                    .map_err(store_error)?;
                fx.store
                    .fence_done(&fx.lease, &self.id, result.clone(), now)
                    .await
                    .map_err(store_error)?;
                self.record("reconciled:done").await;
                return Ok(Answer {
                    result,
                    replayed: true,
                });
            }
            Reconciled::NotHappened => {
                self.record("reconciled:not-done").await;
                return self.perform_again(performs).await;
            }
            Reconciled::Unknown => {}
        }
        if self.effect.idempotent() {
            return self.perform_again(performs).await;
        }
        match fx.on_uncertain {
            OnUncertain::Repeat => self.perform_again(performs).await,
            OnUncertain::Skip => self.mark_uncertain().await,
            OnUncertain::Dead => {
                let e = self.mark_uncertain().await;
                fx.ask_dead_letter(format!(
                    "the outcome of effect {} is unknown and the queue's on_uncertain policy is `dead`",
                    self.name()
                ));
                e
            }
        }
    }

    async fn perform_again(&self, performs: u32) -> Result<Answer, EffectError> {
        let fx = self.effects;
        if performs >= MAX_PERFORMS {
            // Leave the fence started: the next call resolves it again.
            return self
                .refuse(EffectError::Transient(format!(
                    "the outcome of {} stayed unknown after {performs} tries",
                    self.name()
                )))
                .await;
        }
        fx.store
            .fence_take_over(&fx.lease, &self.id, fx.now())
            .await
            .map_err(store_error)?;
        Box::pin(self.perform(performs + 1)).await
    }

    async fn mark_uncertain(&self) -> Result<Answer, EffectError> {
        let fx = self.effects;
        fx.store
            .fence_uncertain(&fx.lease, &self.id, fx.now())
            .await
            .map_err(store_error)?;
        metrics::counter!("khata_fences_uncertain_total", "kind" => self.id.kind.clone())
            .increment(1);
        self.refuse(self.uncertain_error()).await
    }
}
