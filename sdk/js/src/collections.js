// Versioned documents in named collections of the embedded index.
import * as wit from 'khata:plugin/index@0.1.0';
import { call, Fail } from './errors.js';

/**
 * Stores `document` (JSON text) as `id` in `collection` at `version`
 * (a number or BigInt), unless a version at least as new is stored.
 * Returns "inserted", "updated", "unchanged" or "stale".
 */
export function upsert(collection, id, document, version) {
  return call(wit.upsert, collection, id, document, BigInt(version));
}

/** `upsert` with `document` serialized as JSON. */
export function upsertJson(collection, id, document, version) {
  return upsert(collection, id, JSON.stringify(document), version);
}

/** True when an upsert's outcome changed what is stored. */
export function changed(outcome) {
  return outcome === 'inserted' || outcome === 'updated';
}

/** Removes `id` from `collection` as of `version`: true when removed. */
export function remove(collection, id, version) {
  return call(wit.remove, collection, id, BigInt(version));
}

/** The document `id` as JSON text, or undefined. */
export function get(collection, id) {
  return call(wit.get, collection, id) ?? undefined;
}

/** The document `id` parsed, or undefined; bad JSON is a `Fail`. */
export function getJson(collection, id) {
  const text = get(collection, id);
  if (text === undefined) return undefined;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Fail(`index document ${collection}/${id} is not JSON: ${e.message}`);
  }
}
