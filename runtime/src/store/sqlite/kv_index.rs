//! The kv and index reads shared by the handler-facing steps.

use super::*;

pub(super) fn kv_get_step(
    conn: &Connection,
    ns: &str,
    key: &str,
) -> Result<Option<Vec<u8>>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT value FROM kv WHERE namespace = ?1 AND key = ?2")?
        .query_row(params![ns, key], |r| r.get(0))
        .optional()?)
}

pub(super) fn index_read(
    conn: &Connection,
    collection: &str,
    id: &str,
) -> Result<Option<(Option<String>, u64)>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT document, version FROM index_docs WHERE collection = ?1 AND id = ?2",
        )?
        .query_row(params![collection, id], |r| {
            Ok((r.get(0)?, u64::try_from(r.get::<_, i64>(1)?).unwrap_or(0)))
        })
        .optional()?)
}

pub(super) fn version_param(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
