//! `update_search_index`: keeps the `products` collection of the index current
//! (the seed's pattern 2, a versioned upsert).
//!
//! Grants: `kv`, and `index` for `products`.
//! Payload: `{"id": "p1", "name": "Tea", "price": 3.5, "updated_at_ms": 1700000000000}`.
//! Result: `{"id": "p1", "outcome": "inserted" | "updated" | "unchanged" | "stale"}`.
//!
//! The product is upserted with its `updated_at_ms` as the version, so a
//! redelivered or out-of-order job can never overwrite newer data. The newest
//! version seen is also recorded in kv under `indexed:<id>` (decimal text).

use khata_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The payload, and the document stored in the index.
#[derive(Deserialize, Serialize)]
struct Product {
    id: String,
    name: String,
    price: f64,
    updated_at_ms: u64,
}

fn handle(job: Job) -> Result<Value, Error> {
    let product: Product = job.payload()?;
    let version = product.updated_at_ms;
    let outcome = index::upsert_json("products", &product.id, &product, version)?;

    // A stale upsert means a newer version was indexed already; never move the
    // recorded version backwards.
    let key = format!("indexed:{}", product.id);
    if outcome != index::UpsertOutcome::Stale
        && kv::get_json::<u64>(&key)?.is_none_or(|seen| seen < version)
    {
        kv::put_json(&key, &version)?;
    }

    Ok(json!({ "id": product.id, "outcome": outcome }))
}

khata_sdk::handler!(handle);
