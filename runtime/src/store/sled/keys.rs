//! Keys: order-preserving encodings of the trees' keys (big-endian
//! integers, length-prefixed strings), so that a range scan of a tree is
//! the order a step needs.

use super::*;

pub(super) fn put_str(k: &mut Vec<u8>, s: &str) {
    let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
    k.extend_from_slice(&len.to_be_bytes());
    k.extend_from_slice(s.as_bytes());
}

pub(super) fn put_i64(k: &mut Vec<u8>, v: i64) {
    k.extend_from_slice(&((v as u64) ^ (1 << 63)).to_be_bytes());
}

pub(super) fn get_i64(b: &[u8]) -> Option<i64> {
    let a: [u8; 8] = b.get(..8)?.try_into().ok()?;
    Some((u64::from_be_bytes(a) ^ (1 << 63)) as i64)
}

pub(super) fn strs(parts: &[&str]) -> Vec<u8> {
    let mut k = Vec::new();
    for p in parts {
        put_str(&mut k, p);
    }
    k
}

pub(super) fn ready_key(queue: &str, priority: i32, run_at: Millis, seq: u64) -> Vec<u8> {
    let mut k = strs(&[queue]);
    // Higher priority first: the order-preserving u32 of the i32, inverted.
    k.extend_from_slice(&(!((priority as u32) ^ 0x8000_0000)).to_be_bytes());
    put_i64(&mut k, run_at.0);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub(super) fn due_key(queue: &str, run_at: Millis, seq: u64) -> Vec<u8> {
    let mut k = strs(&[queue]);
    put_i64(&mut k, run_at.0);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub(super) fn by_state_key(queue: &str, state: JobState, seq: u64) -> Vec<u8> {
    let mut k = strs(&[queue, state.as_str()]);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub(super) fn finished_key(at: Millis, id: &str) -> Vec<u8> {
    let mut k = Vec::new();
    put_i64(&mut k, at.0);
    k.extend_from_slice(id.as_bytes());
    k
}

pub(super) fn kv_time_key(ns: &str, written_at: Millis, key: &str) -> Vec<u8> {
    let mut k = strs(&[ns]);
    put_i64(&mut k, written_at.0);
    put_str(&mut k, key);
    k
}

/// A kv value as stored: its write time, then its bytes.
pub(super) fn kv_value(written_at: Millis, value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + value.len());
    put_i64(&mut v, written_at.0);
    v.extend_from_slice(value);
    v
}

/// The write time and bytes of a stored kv value.
pub(super) fn split_kv_value(stored: &[u8]) -> Result<(Millis, &[u8]), StoreError> {
    match (get_i64(stored), stored.get(8..)) {
        (Some(at), Some(value)) => Ok((Millis(at), value)),
        _ => Err(unavailable(
            "sled: a kv value shorter than its written time: the ledger is damaged",
        )),
    }
}

pub(super) fn attempt_key(job_id: &str, number: u32) -> Vec<u8> {
    let mut k = strs(&[job_id]);
    k.extend_from_slice(&number.to_be_bytes());
    k
}

pub(super) fn fence_key(id: &FenceId) -> Vec<u8> {
    strs(&[&id.namespace, &id.kind, &id.key])
}

/// A time-ordered entry of `fences_by_time` or `tombstones`: the time, then
/// the key of the record it points at.
pub(super) fn fence_time_key(updated_at: Millis, fence_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::new();
    put_i64(&mut k, updated_at.0);
    k.extend_from_slice(fence_key);
    k
}

pub(super) fn effect_prefix(job_id: &str, attempt: u32) -> Vec<u8> {
    attempt_key(job_id, attempt)
}

/// Splits a length-prefixed string off the front of `b`.
pub(super) fn split_str(b: &[u8]) -> Option<(&str, &[u8])> {
    let len = u32::from_be_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let s = std::str::from_utf8(b.get(4..4 + len)?).ok()?;
    Some((s, &b[4 + len..]))
}

pub(super) fn corrupt(tree: usize, key: &[u8]) -> StoreError {
    unavailable(format!(
        "corrupt key in sled tree {}: {}",
        TREE_NAMES[tree],
        hex::encode(key)
    ))
}
