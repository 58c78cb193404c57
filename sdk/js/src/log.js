// Log lines into the daemon's log, tagged with the job's id and attempt.
// Not fenced or deduplicated: a retried handler logs again. No grant needed.
import { log as witLog } from 'khata:plugin/log@0.1.0';

const LEVELS = ['trace', 'debug', 'info', 'warn', 'error'];

/** Logs `message` at `level` ("trace", "debug", "info", "warn", "error"). */
export function log(level, message) {
  if (!LEVELS.includes(level)) {
    throw new TypeError(`log level must be one of ${LEVELS.join(', ')}, got ${level}`);
  }
  witLog(level, String(message));
}
export const trace = (m) => log('trace', m);
export const debug = (m) => log('debug', m);
export const info = (m) => log('info', m);
export const warn = (m) => log('warn', m);
export const error = (m) => log('error', m);
