//! Records: the serialized values of the trees, and their conversions to
//! the daemon's types.

use super::*;

/// A job as stored. `state` is never `delayed`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct JobRec {
    pub(super) id: String,
    pub(super) queue: String,
    pub(super) state: JobState,
    pub(super) payload: String,
    pub(super) priority: i32,
    pub(super) run_at: Millis,
    pub(super) seq: u64,
    pub(super) attempt: u32,
    pub(super) budget_used: u32,
    pub(super) max_attempts: u32,
    pub(super) dedup_key: Option<String>,
    pub(super) enqueued_at: Millis,
    pub(super) finished_at: Option<Millis>,
    pub(super) result: Option<String>,
    pub(super) last_error: Option<String>,
    pub(super) lease_token: Option<u64>,
}

impl JobRec {
    pub(super) fn to_job(&self, now: Millis) -> Job {
        Job {
            id: self.id.clone(),
            queue: self.queue.clone(),
            state: visible_state(self.state, self.run_at, now),
            payload: self.payload.clone(),
            priority: self.priority,
            attempt: self.attempt,
            budget_used: self.budget_used,
            max_attempts: self.max_attempts,
            dedup_key: self.dedup_key.clone(),
            run_at: self.run_at,
            enqueued_at: self.enqueued_at,
            finished_at: self.finished_at,
            result: self.result.clone(),
            last_error: self.last_error.clone(),
            attempts: Vec::new(),
        }
    }

    /// The secondary entries this record owns: (tree, key, value).
    pub(super) fn derived(&self) -> Vec<(usize, Vec<u8>, Vec<u8>)> {
        let id = self.id.as_bytes().to_vec();
        let mut out = vec![
            (BY_SEQ, self.seq.to_be_bytes().to_vec(), id.clone()),
            (
                BY_STATE,
                by_state_key(&self.queue, self.state, self.seq),
                id.clone(),
            ),
        ];
        match self.state {
            JobState::Waiting | JobState::Delayed => {
                out.push((
                    READY,
                    ready_key(&self.queue, self.priority, self.run_at, self.seq),
                    id.clone(),
                ));
                out.push((DUE, due_key(&self.queue, self.run_at, self.seq), id));
            }
            JobState::Active => out.push((ACTIVE, id, Vec::new())),
            JobState::Completed | JobState::Cancelled => {
                if let Some(at) = self.finished_at {
                    out.push((FINISHED, finished_key(at, &self.id), id));
                }
            }
            JobState::Dead => {
                if let Some(at) = self.finished_at {
                    out.push((DEAD, finished_key(at, &self.id), id));
                }
            }
        }
        out
    }
}

// An attempt is stored as the record a copy moves.
pub(super) use crate::store::copy::AttemptRecord as AttemptRec;

impl AttemptRec {
    pub(super) fn to_attempt(&self) -> Attempt {
        Attempt {
            number: self.number,
            fencing_token: self.token,
            started_at: self.started_at,
            ended_at: self.ended_at,
            outcome: self.outcome,
            error: self.error.clone(),
            plugin_version: self.plugin_version.clone(),
        }
    }
}

/// A dedup key points at the job that holds it; `hold_until` keeps it held
/// after that job ends (`dedup_for`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct DedupRec {
    pub(super) job_id: String,
    pub(super) hold_until: Option<Millis>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(in crate::store) struct DocRec {
    pub(super) version: u64,
    pub(super) document: Option<String>,
    pub(super) updated_at: Millis,
}

// A fence is stored as the record a copy moves.
pub(super) use crate::store::copy::FenceRecord as FenceRec;

impl FenceRec {
    pub(super) fn to_fence(&self) -> Fence {
        rules::FenceRow::into_fence(self.clone())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct EffectRec {
    pub(super) kind: String,
    pub(super) key: String,
    pub(super) outcome: String,
    pub(super) at: Millis,
}

pub(super) fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Serializing these plain records cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

pub(super) fn decode<T: DeserializeOwned>(
    tree: usize,
    key: &[u8],
    bytes: &[u8],
) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| {
        unavailable(format!(
            "corrupt record in sled tree {} at key {}: {e}",
            TREE_NAMES[tree],
            hex::encode(key)
        ))
    })
}
