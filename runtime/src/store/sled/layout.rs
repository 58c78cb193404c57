//! Moving a ledger of an older layout to [`LAYOUT_VERSION`] at open.

use super::*;

/// Brings a layout 1 ledger to layout 2 in one transaction (the layout
/// number with it, so that a crash leaves version 1 whole): `dead` and
/// `tombstones` entries for what exists, and every kv value prefixed with
/// `now` as its written time. The writer's first flush makes it durable.
pub(super) fn migrate_layout(trees: &Arc<Trees>, now: Millis) -> Result<(), StoreError> {
    let mut tx = Tx {
        trees: Arc::clone(trees),
        writes: BTreeMap::new(),
        next_token: 0,
        next_seq: 0,
    };
    for entry in trees.t[JOBS].iter() {
        let (k, v) = entry.map_err(sled_err)?;
        let job: JobRec = decode(JOBS, &k, &v)?;
        if job.state == JobState::Dead {
            for (tree, key, value) in job.derived() {
                if tree == DEAD {
                    tx.insert(tree, key, value);
                }
            }
        }
    }
    for entry in trees.t[KV].iter() {
        let (k, v) = entry.map_err(sled_err)?;
        let (ns, rest) = split_str(&k).ok_or_else(|| corrupt(KV, &k))?;
        let (key, _) = split_str(rest).ok_or_else(|| corrupt(KV, &k))?;
        tx.put_kv(ns, key, None, Some((now, &v)));
    }
    for entry in trees.t[INDEX].iter() {
        let (k, v) = entry.map_err(sled_err)?;
        let doc: DocRec = decode(INDEX, &k, &v)?;
        tx.put_doc(k.to_vec(), None, Some(&doc));
    }
    tx.insert(
        META,
        b"layout".to_vec(),
        LAYOUT_VERSION.to_be_bytes().to_vec(),
    );
    tx.commit()
}
