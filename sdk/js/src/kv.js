// Key-value data in the queue's namespace. The queue needs the `kv` grant.
import * as wit from 'khata:plugin/kv@0.1.0';
import { call, Fail } from './errors.js';

const encoder = new TextEncoder();
const decoder = new TextDecoder();
const bytes = (v) => (typeof v === 'string' ? encoder.encode(v) : v);

/** The value at `key` (a Uint8Array), or undefined when there is none. */
export function get(key) {
  return call(wit.get, key) ?? undefined;
}

/** The value at `key` parsed as JSON, or undefined; bad JSON is a `Fail`. */
export function getJson(key) {
  const v = get(key);
  if (v === undefined) return undefined;
  try {
    return JSON.parse(decoder.decode(v));
  } catch (e) {
    throw new Fail(`kv value ${JSON.stringify(key)} is not the expected JSON: ${e.message}`);
  }
}

/** Sets `key` to `value` (a Uint8Array, or a string stored as UTF-8). */
export function put(key, value) {
  call(wit.put, key, bytes(value));
}

/** Sets `key` to `value` encoded as JSON text. */
export function putJson(key, value) {
  put(key, JSON.stringify(value));
}

/** Sets `key` only if it has no value: true when this call inserted it. */
export function insertIfAbsent(key, value) {
  return call(wit.insertIfAbsent, key, bytes(value));
}

/** Removes `key`: true when a value was deleted. */
export function del(key) {
  return call(wit.delete, key);
}
export { del as delete };
