// `echo` in JavaScript: returns its payload as the result. The twin of the
// Rust `plugins/echo`; it needs no grant. The benchmark's measure of what
// the language costs on its own (figure 9).
import { handler } from 'khata-sdk';

export const handle = handler((job) => job.payload());
