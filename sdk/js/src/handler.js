import { EffectError, Fail, JobError } from './errors.js';
import { Job } from './job.js';

/**
 * Runs `fn` on one delivery; the component's `handle`. Returns the result
 * as JSON text, or throws the WIT job-error (`{tag, val}`).
 */
export function run(fn, raw) {
  let value;
  try {
    value = fn(new Job(raw));
    if (value && typeof value.then === 'function') {
      throw new Fail('the handler returned a Promise; a handler is synchronous');
    }
  } catch (e) {
    throw toWit(e);
  }
  let text;
  try {
    text = JSON.stringify(value === undefined ? null : value);
  } catch (e) {
    throw toWit(new Fail(`the result is not JSON: ${e.message}`));
  }
  return text;
}

function toWit(e) {
  let error = e;
  if (e instanceof EffectError) error = e.toJobError();
  else if (!(e instanceof JobError)) {
    const what = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
    error = new Fail(`unhandled ${what}`);
  }
  return { tag: error.kind, val: error.message };
}

/**
 * Makes `fn(job)` the component's `handle`: `export const handle =
 * handler((job) => ...)`. The return value becomes the job's JSON result;
 * a thrown `Retry` or `Fail` ends the attempt so; an uncaught `EffectError`
 * retries or fails as its kind says; anything else fails the job.
 */
export function handler(fn) {
  return (raw) => run(fn, raw);
}
