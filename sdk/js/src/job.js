import { Fail } from './errors.js';

/**
 * One delivery of a job. `id` is stable across every retry; `attempt`
 * grows by one on each delivery, starting at 1.
 */
export class Job {
  constructor({ id, queue, payload, attempt = 1, maxAttempts = 1, enqueuedAtMs = 0 }) {
    this.id = id;
    this.queue = queue;
    this.attempt = attempt;
    this.maxAttempts = maxAttempts;
    this.enqueuedAtMs = Number(enqueuedAtMs);
    this.payloadText = payload;
  }

  /** True when a `Retry` from this attempt dead-letters the job. */
  isLastAttempt() {
    return this.attempt >= this.maxAttempts;
  }

  /**
   * The payload parsed from JSON; with `check`, `check(value)`'s return.
   * A payload that does not parse is a `Fail` ("bad payload: ...").
   */
  payload(check) {
    let value;
    try {
      value = JSON.parse(this.payloadText);
    } catch (e) {
      throw new Fail(`bad payload: ${e.message}`);
    }
    return check ? check(value) : value;
  }

  /** A job-scoped idempotency key, `<job-id>:<name>`. */
  key(name) {
    return `${this.id}:${name}`;
  }
}

/**
 * Reads field `name` of payload object `value`, checking its type: one of
 * "string", "number", "integer", "boolean", "object", "array", "any".
 * A missing field or a wrong type is a `Fail` naming the field.
 */
export function field(value, name, type = 'any') {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    throw new Fail(`bad payload: expected an object, got ${describe(value)}`);
  }
  if (!(name in value)) throw new Fail(`bad payload: missing field \`${name}\``);
  const v = value[name];
  const ok =
    type === 'any' ||
    (type === 'integer' && Number.isInteger(v)) ||
    (type === 'array' && Array.isArray(v)) ||
    (type === 'object' && v !== null && typeof v === 'object' && !Array.isArray(v)) ||
    (type !== 'integer' && type !== 'array' && type !== 'object' && typeof v === type);
  if (!ok) {
    throw new Fail(`bad payload: field \`${name}\` must be ${article(type)}, got ${describe(v)}`);
  }
  return v;
}

function article(type) {
  return /^[aeiou]/.test(type) ? `an ${type}` : `a ${type}`;
}

function describe(v) {
  if (v === null) return 'null';
  if (Array.isArray(v)) return 'an array';
  if (typeof v === 'object') return 'an object';
  return `${typeof v} ${JSON.stringify(v)}`;
}
