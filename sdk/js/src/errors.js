// How a handler gives up on an attempt, and why an effect was not performed.

/** How a handler gives up on this attempt: throw a `Retry` or a `Fail`. */
export class JobError extends Error {
  constructor(message) {
    super(message);
    this.name = this.constructor.name;
  }
  /** `"retry"` or `"fail"`, as the WIT `job-error` names it. */
  get kind() {
    return this instanceof Retry ? 'retry' : 'fail';
  }
  /** True for `Retry`. */
  isRetry() {
    return this instanceof Retry;
  }
}

/** Transient: the daemon backs off and delivers the job again. */
export class Retry extends JobError {}

/** Permanent: the job goes to the dead-letter queue now. */
export class Fail extends JobError {}

/** Why the host did not perform an effect; thrown by every effect function. */
export class EffectError extends Error {
  constructor(message) {
    super(message);
    this.name = this.constructor.name;
  }
  /** The WIT name of the variant, such as `"key-reused"`. */
  get kind() {
    return KINDS.get(this.constructor) ?? 'unknown';
  }
  /** True when a later attempt may succeed: in-progress, transient, fenced. */
  isRetryable() {
    return this instanceof InProgress || this instanceof Transient || this instanceof Fenced;
  }
  /** The `Retry` or `Fail` an uncaught effect error becomes. */
  toJobError() {
    const message = `effect ${this.kind}: ${this.message}`;
    return this.isRetryable() ? new Retry(message) : new Fail(message);
  }
}

/** Not granted to this queue. */
export class Denied extends EffectError {}
/** The key was done before with another request. */
export class KeyReused extends EffectError {}
/** A live attempt holds this fence. */
export class InProgress extends EffectError {}
/** This attempt no longer holds the job's lease. */
export class Fenced extends EffectError {}
/** The outcome of an earlier try is unknown; the queue's policy is skip. */
export class Uncertain extends EffectError {}
/** The provider failed; safe to retry. */
export class Transient extends EffectError {}
/** The provider refused; retrying won't help. */
export class Rejected extends EffectError {}
/** The request itself is malformed. */
export class Invalid extends EffectError {}

/** An effect was called outside a component: there is no daemon. */
export class NoHost extends Error {}

const BY_TAG = new Map([
  ['denied', Denied],
  ['key-reused', KeyReused],
  ['in-progress', InProgress],
  ['fenced', Fenced],
  ['uncertain', Uncertain],
  ['transient', Transient],
  ['rejected', Rejected],
  ['invalid', Invalid],
]);
const KINDS = new Map([...BY_TAG].map(([tag, cls]) => [cls, tag]));

/**
 * Calls a generated import; the `err` it throws (a value with `payload:
 * {tag, val}`) becomes the matching `EffectError`.
 */
export function call(fn, ...args) {
  try {
    return fn(...args);
  } catch (e) {
    const cls = e && e.payload && BY_TAG.get(e.payload.tag);
    if (cls) throw new cls(String(e.payload.val));
    throw e;
  }
}
