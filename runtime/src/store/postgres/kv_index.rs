//! The index steps: versioned upserts and removals that leave tombstones.

use super::*;

/// A document (or tombstone) and its version; with `lock`, the row is locked.
pub(super) async fn index_read<C: GenericClient>(
    c: &C,
    collection: &str,
    id: &str,
    lock: bool,
) -> Result<Option<(Option<String>, u64)>, Fail> {
    let sql = if lock {
        "SELECT document, version FROM index_docs WHERE collection = $1 AND id = $2 FOR UPDATE"
    } else {
        "SELECT document, version FROM index_docs WHERE collection = $1 AND id = $2"
    };
    match row_opt(c, sql, &[&collection, &id]).await? {
        Some(r) => Ok(Some((r.try_get(0)?, u64_of(r.try_get(1)?)))),
        None => Ok(None),
    }
}

pub(super) async fn index_upsert_step<C: GenericClient>(
    c: &C,
    collection: &str,
    id: &str,
    document: &str,
    version: u64,
    now: Millis,
) -> Result<UpsertOutcome, Fail> {
    let v = i64_of(version);
    for _ in 0..MAX_RERUNS {
        let outcome = match index_read(c, collection, id, true).await? {
            Some((doc, stored)) => match rules::upsert(Some((doc.is_some(), stored)), version) {
                o @ (UpsertOutcome::Inserted | UpsertOutcome::Updated) => o,
                o => return Ok(o),
            },
            None => {
                let inserted = exec(
                    c,
                    "INSERT INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES ($1, $2, $3, $4, $5) ON CONFLICT (collection, id) DO NOTHING",
                    &[&collection, &id, &v, &document, &now.0],
                )
                .await?;
                if inserted == 1 {
                    return Ok(UpsertOutcome::Inserted);
                }
                // A concurrent upsert created it: compare with that one.
                continue;
            }
        };
        exec(
            c,
            "UPDATE index_docs SET version = $3, document = $4, updated_at = $5 \
             WHERE collection = $1 AND id = $2",
            &[&collection, &id, &v, &document, &now.0],
        )
        .await?;
        return Ok(outcome);
    }
    Err(Fail::Rerun(format!(
        "index document {collection}/{id} kept changing"
    )))
}

pub(super) async fn index_remove_step<C: GenericClient>(
    c: &C,
    collection: &str,
    id: &str,
    version: u64,
    now: Millis,
) -> Result<bool, Fail> {
    let v = i64_of(version);
    for _ in 0..MAX_RERUNS {
        let removed = match index_read(c, collection, id, true).await? {
            Some((doc, stored)) => match rules::remove(Some((doc.is_some(), stored)), version) {
                Some(removed) => removed,
                None => return Ok(false),
            },
            None => {
                let inserted = exec(
                    c,
                    "INSERT INTO index_docs (collection, id, version, document, updated_at) \
                     VALUES ($1, $2, $3, NULL, $4) ON CONFLICT (collection, id) DO NOTHING",
                    &[&collection, &id, &v, &now.0],
                )
                .await?;
                if inserted == 1 {
                    return Ok(false);
                }
                continue;
            }
        };
        exec(
            c,
            "UPDATE index_docs SET version = $3, document = NULL, updated_at = $4 \
             WHERE collection = $1 AND id = $2",
            &[&collection, &id, &v, &now.0],
        )
        .await?;
        return Ok(removed);
    }
    Err(Fail::Rerun(format!(
        "index document {collection}/{id} kept changing"
    )))
}
