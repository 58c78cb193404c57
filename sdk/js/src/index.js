// Write khata job handlers in JavaScript. See index.d.ts for the documented
// API and docs/handlers/js.md for the walk-through.
export {
  JobError,
  Retry,
  Fail,
  EffectError,
  Denied,
  KeyReused,
  InProgress,
  Fenced,
  Uncertain,
  Transient,
  Rejected,
  Invalid,
} from './errors.js';
export { Job, field } from './job.js';
export { handler } from './handler.js';
export * as kv from './kv.js';
export * as index from './collections.js';
export * as email from './email.js';
export * as http from './http.js';
export * as log from './log.js';
