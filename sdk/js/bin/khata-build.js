#!/usr/bin/env node
// Builds a JavaScript handler into a khata plugin component:
//
//   node sdk/js/bin/khata-build.js handler.js -o charge_customer.wasm
//
// The handler is an ES module that exports `handle` (made with `handler`
// from 'khata-sdk'). It is bundled with rolldown ('khata-sdk' resolves to
// this package; the `khata:plugin/*` interfaces stay imports), and the
// bundle's imports decide the world: a component imports only the khata
// interfaces its handler uses, so its queue needs only those grants. The
// bundle is then componentized by componentize-js with every WASI feature
// disabled (no clock, randomness, stdio or network inside a handler: what it
// does must come from its job and its effects). The output is written
// through a temporary file, so a daemon watching its directory never loads
// half a component.
import { mkdtemp, readdir, readFile, rename, rm, writeFile, cp } from 'node:fs/promises';
import { existsSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

const INTERFACES = ['kv', 'index', 'email', 'http', 'log'];
const WORLD = 'handler-build';
const here = path.dirname(fileURLToPath(import.meta.url));

class BuildError extends Error {}

function defaultWit() {
  if (process.env.KHATA_WIT) return process.env.KHATA_WIT;
  return path.resolve(here, '../../../wit');
}

/** The khata interfaces `code` (an ES module) imports. */
export function usedInterfaces(code) {
  const used = new Set();
  const re = /\b(?:from|import)\s*["']khata:plugin\/([a-z-]+)@[^"']*["']/g;
  for (const m of code.matchAll(re)) {
    if (m[1] !== 'types') used.add(m[1]);
  }
  return used;
}

function worldSource(packageLine, imports) {
  const lines = [packageLine, '', `world ${WORLD} {`];
  for (const name of INTERFACES) if (imports.has(name)) lines.push(`  import ${name};`);
  lines.push(
    '  use types.{job, job-error};',
    '  export handle: func(job: job) -> result<string, job-error>;',
    '}',
    '',
  );
  return lines.join('\n');
}

async function packageLine(wit) {
  for (const name of (await readdir(wit)).sort()) {
    if (!name.endsWith('.wit')) continue;
    const text = await readFile(path.join(wit, name), 'utf8');
    const line = text.split('\n').find((l) => l.trim().startsWith('package '));
    if (line) return line.trim();
  }
  throw new BuildError(`${wit}: no .wit file with a \`package\` line; pass --wit DIR`);
}

/** Builds `handler` into `output`; returns the khata interfaces it imports. */
export async function build(handler, output, wit) {
  handler = path.resolve(handler);
  if (!existsSync(handler) || !statSync(handler).isFile()) {
    throw new BuildError(`${handler}: no such file`);
  }
  if (!existsSync(wit) || !statSync(wit).isDirectory()) {
    throw new BuildError(`${wit}: no such WIT directory; pass --wit DIR or set KHATA_WIT`);
  }
  const { rolldown } = await import('rolldown');
  const { componentize } = await import('@bytecodealliance/componentize-js');
  let code;
  try {
    const bundle = await rolldown({
      input: handler,
      external: [/^khata:plugin\//],
      resolve: { alias: { 'khata-sdk': path.resolve(here, '../src/index.js') } },
      treeshake: { moduleSideEffects: false },
      logLevel: 'warn',
    });
    const { output: chunks } = await bundle.generate({ format: 'esm' });
    await bundle.close();
    code = chunks[0].code;
  } catch (e) {
    throw new BuildError(`bundling ${handler} failed: ${e.message}`);
  }
  if (!/\bhandle\b/.test(code) || !/export\s*\{[^}]*\bhandle\b/.test(code)) {
    throw new BuildError(
      `${handler} exports no \`handle\`; add \`export const handle = handler((job) => ...)\``,
    );
  }
  const imports = usedInterfaces(code);
  imports.add('log');
  const tmp = await mkdtemp(path.join(tmpdir(), 'khata-build-'));
  try {
    await cp(wit, path.join(tmp, 'wit'), { recursive: true });
    await writeFile(
      path.join(tmp, 'wit', 'khata-build-world.wit'),
      worldSource(await packageLine(wit), imports),
    );
    const source = path.join(tmp, 'handler.js');
    await writeFile(source, code);
    let component;
    try {
      ({ component } = await componentize({
        sourcePath: source,
        witPath: path.join(tmp, 'wit'),
        worldName: WORLD,
        disableFeatures: ['stdio', 'random', 'clocks', 'http', 'fetch-event'],
      }));
    } catch (e) {
      throw new BuildError(`componentize-js failed on ${handler}: ${e.message}`);
    }
    const partial = path.join(path.dirname(output), `.${path.basename(output)}.partial`);
    await writeFile(partial, component);
    await rename(partial, output);
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
  return INTERFACES.filter((name) => imports.has(name));
}

async function main() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      output: { type: 'string', short: 'o' },
      wit: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  });
  if (values.help || positionals.length !== 1 || !values.output) {
    console.error('usage: khata-build HANDLER.js -o OUTPUT.wasm [--wit DIR]');
    process.exit(values.help ? 0 : 2);
  }
  try {
    const used = await build(positionals[0], values.output, values.wit ?? defaultWit());
    const size = statSync(values.output).size;
    console.log(`built ${values.output} (${size} bytes), importing khata ${used.join(', ')}`);
  } catch (e) {
    console.error(`error: ${e instanceof BuildError ? e.message : e.stack}`);
    process.exit(1);
  }
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  await main();
}
