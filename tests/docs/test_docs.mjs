// test_docs.mjs - the docs match the code: every --flag that README.md and docs/*.md give a
// program is in that program's --help, and every file the docs name exists in the tree.
//
//   node test_docs.mjs SOURCE_DIR BIN_DIR [FILE.md ...]
// (default files: README.md and docs/*.md of SOURCE_DIR; BIN_DIR holds the built programs).
//
// Flags. A program invocation is a program's name (statectl, strata, strata-server,
// strata-mkmodel; also as build/tools/NAME) at the start of a command in a code block, or at the
// start of an inline `code span` in the text, followed by a verb the program has (statectl and
// strata) or a flag. Its flags are the --words up to the end of the command (a `#` comment, `;`,
// `&&`, a pipe into another program; a `|` followed by another verb of the same program, as in
// "statectl ls STORE | show STORE ...", starts that verb's command). Each is looked up in the
// help of the verb (`statectl VERB --help`, `strata VERB --help` where the verb has its own, else
// `strata --help`), or in the union of all of a program's help texts when no verb is named
// ("strata --session-in").
// Files. Paths under the tree's folders (codec/ ... docs/, and top-level files) and bare source
// names (st_file.c, test_install.sh, ...) must exist (bare names: anywhere in the tree); the
// generated and outside paths (build*, models/, data/, tests/ref/node_modules, tmp files) are
// allowed by ALLOW below, as are placeholders (a path part in capitals: NAME, FILE, ID).
// The build files (every CMakeLists.txt and *.cmake) get the file check too.
// Exit 0 when everything matches; 1 listing each mismatch as FILE:LINE: what.
import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync, readdirSync, statSync } from 'node:fs';
import path from 'node:path';

const [src, bin, ...only] = process.argv.slice(2);
if (!src || !bin) {
  console.error('usage: node test_docs.mjs SOURCE_DIR BIN_DIR [FILE.md ...]');
  process.exit(2);
}
const files = only.length ? only : ['README.md', ...readdirSync(path.join(src, 'docs'))
  .filter((f) => f.endsWith('.md')).map((f) => `docs/${f}`)];

// ---- help texts ----------------------------------------------------------------------------------
function help(prog, ...args) {
  try {
    return execFileSync(path.join(bin, prog), [...args, '--help'],
      { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (e) {
    return null; // no such verb, or its --help fails: the verb has no help of its own
  }
}
const flagsOf = (text) => new Set(text.match(/--[a-z0-9][a-z0-9-]*/g) ?? []);
const PROGRAMS = ['strata-server', 'strata-mkmodel', 'statectl', 'strata'];
const helps = {}; // prog -> { '': flags of prog --help, verb: flags of its own help, ... }
const verbsOf = {}; // prog -> Set of verbs
for (const prog of PROGRAMS) {
  if (!existsSync(path.join(bin, prog))) {
    console.error(`test_docs: ${bin}/${prog} not built`);
    process.exit(1);
  }
  const top = help(prog);
  if (top === null) {
    console.error(`test_docs: ${prog} --help failed`);
    process.exit(1);
  }
  helps[prog] = { '': flagsOf(top) };
  verbsOf[prog] = new Set();
  if (prog === 'statectl' || prog === 'strata') {
    // the verbs --help names: "  verb ARGS" (statectl) or "strata verb" (strata's usage lines)
    const re = prog === 'statectl' ? /^ {2}([a-z][a-z-]*) /gm : /strata ([a-z][a-z-]*)/g;
    for (const m of top.matchAll(re)) verbsOf[prog].add(m[1]);
    for (const verb of verbsOf[prog]) {
      const h = help(prog, verb);
      // strata's generate / info / logits print the top usage: their flags are the top's
      if (h !== null && h !== top) helps[prog][verb] = flagsOf(h);
    }
  }
  helps[prog]['*'] = new Set(Object.values(helps[prog]).flatMap((s) => [...s]));
}

// ---- invocations -----------------------------------------------------------------------------------
let checked = 0; // flags looked up
const progRe = /(?:^|[\s`(\/])(strata-server|strata-mkmodel|statectl|strata)(?= )/g;
function checkCommand(where, text, problems) {
  for (const m of text.matchAll(progRe)) {
    const prog = m[1];
    // cut at what ends one command
    let rest = text.slice(m.index + m[0].length).split(/\s#|;|&&|`/)[0];
    const words = rest.trim().split(/\s+/);
    let verb = '';
    if (verbsOf[prog].size) {
      if (verbsOf[prog].has(words[0])) verb = words[0];
      else if (!/^--/.test(words[0] ?? '')) continue; // prose ("strata binary"), not a command
      else verb = '*';
    } else if (!/^-/.test(words[0] ?? '')) {
      continue;
    }
    // split at "| verb" of the same program; a pipe into another program ends the command
    const parts = [];
    let cur = { verb, words: [] };
    for (let i = verb && verb !== '*' ? 1 : 0; i < words.length; i++) {
      const w = words[i];
      if (w === '|') {
        if (verbsOf[prog].has(words[i + 1])) {
          parts.push(cur);
          cur = { verb: words[++i], words: [] };
          continue;
        }
        break;
      }
      cur.words.push(w);
    }
    parts.push(cur);
    for (const p of parts) {
      const known = helps[prog][p.verb] ?? helps[prog][''];
      for (const w of p.words) {
        for (const f of w.match(/(?<![\w-])--[a-z0-9][a-z0-9-]*/g) ?? []) {
          // --prompt-cache* names a family of flags
          if (w.includes(`${f}*`) && [...known].some((k) => k.startsWith(f))) continue;
          checked++;
          if (!known.has(f)) {
            const v = p.verb && p.verb !== '*' ? ` ${p.verb}` : '';
            problems.push(`${where}: ${prog}${v} has no ${f} in its --help`);
          }
        }
      }
    }
  }
}

// ---- files -------------------------------------------------------------------------------------------
// the tree: tracked files and new ones not ignored
const tree = execFileSync('git', ['-C', src, 'ls-files', '--cached', '--others', '--exclude-standard'],
  { encoding: 'utf8' }).split('\n').filter(Boolean);
const basenames = new Set(tree.map((f) => path.basename(f)));
const dirs = new Set(tree.flatMap((f) => {
  const out = [];
  for (let d = path.dirname(f); d !== '.'; d = path.dirname(d)) out.push(d);
  return out;
}));
// Generated or outside the tree: the build directories, what `make run` / `make deps` make, the
// test's and the benchmarks' scratch files, and paths of other projects (llama.cpp's).
const ALLOW = [
  /^build[^/]*\//, /^models\//, /^data\//, /^backups\//, /^tests\/ref\/node_modules/, /^tests\/tmp/,
  /^tests\/ref\/package(-lock)?\.json$/, // present: listed for completeness
  /^\/[a-z]/, // absolute paths: the system's (/proc/meminfo, /usr/local/cuda ...)
  /^(src|ggml|include|common|examples|tools|gguf-py)\/.*(llama|ggml|gguf)/, // llama.cpp's tree
  /^common\/st_common\.h$/, // cmake/install.cmake installs it once the common/ module is in
];
const TOPS = ['codec', 'statestore', 'migrations', 'engine', 'api', 'tools', 'tests', 'bench',
  'docs', 'cmake', 'common', '.ci'];
const pathRe = new RegExp(String.raw`(?<![\w./-])((?:${TOPS.map((t) => t.replace('.', '\\.'))
  .join('|')})/[\w./*{}@-]*[\w*/}])`, 'g');
const bareRe = /(?<![\w./-])([A-Za-z][\w-]*\.(?:c|h|cu|cuh|sh|mjs|cmake|md))(?![\w])/g;
const placeholder = (p) => p.split('/').some((s) => /^[A-Z][A-Z0-9_]+(\.[a-z]+)?$/.test(s) &&
  !/^(README|CMakeLists|API|ENGINE|FORMAT|CODECS|MODELS|OPERATIONS|STORE|BENCHMARKS|PACKAGING|DESIGN|STYLE)/.test(s));
function exists(p) {
  p = p.replace(/[.:,]+$/, '');
  if (ALLOW.some((re) => re.test(p)) || placeholder(p) || /[{}]/.test(p)) return true;
  if (p.includes('*')) {
    const re = new RegExp('^' + p.replace(/[.+^$()|[\]\\]/g, '\\$&').replace(/\*/g, '[^/]*') +
      '(/.*)?$');
    return tree.some((f) => re.test(f));
  }
  const q = p.replace(/\/$/, '');
  return tree.includes(q) || dirs.has(q);
}
function checkPaths(where, line, problems) {
  for (const m of line.matchAll(pathRe)) {
    if (!exists(m[1])) problems.push(`${where}: ${m[1]} does not exist`);
  }
  for (const m of line.matchAll(bareRe)) {
    const name = m[1];
    if (m.index > 0 && line[m.index - 1] === '/') continue; // part of a path above
    if (!basenames.has(name) && !ALLOW_BARE.has(name) && !/NAME|^ggml-/.test(name)) {
      problems.push(`${where}: ${name} is no file of the tree`);
    }
  }
}
// bare names of files outside the tree (generated ones, other projects')
const ALLOW_BARE = new Set(['st_web_page.c', 'xxhash.h', 'lmdb.h', 'mdb.c', 'zstd.h', 'ggml.c',
  'ggml-quants.c', 'llama.h', 'cuda_runtime.h', 'cuda_bf16.h', 'cuda_fp16.h', 'jansson.h',
  'event.h', 'cmocka.h', 'st_version.h', 'st_install_all.h',
  // the project's shared documents beside the tree (../shared/)
  'DESIGN.md', 'ARCHITECTURES.md', 'STYLE.md', 'REFERENCE.md',
  // C's headers; placeholders (tests/CMakeLists.txt, docs/PACKAGING.md)
  'stddef.h', 'stdint.h', 'stdio.h', 'stdlib.h', 'string.h', 'a.c', 'app.c']);

// flags of every program; of the tree's other commands (the benchmarks, bench/*.mjs,
// tools/run.sh, tests/ref's scripts: the flag's text is in their source); of outside tools
const anyFlag = new Set(PROGRAMS.flatMap((p) => [...helps[p]['*']]));
const otherText = tree.filter((f) => /^(bench\/|tools\/run\.sh$|tests\/ref\/[^/]*\.mjs$|Makefile$)/.test(f))
  .map((f) => readFileSync(path.join(src, f), 'utf8')).join('\n');
for (const f of otherText.match(/--[a-z0-9][a-z0-9-]*/g) ?? []) anyFlag.add(f);
const OTHER_FLAGS = new Set([
  '--pure', '--allow-requantize', '--imatrix', // llama.cpp's llama-quantize
  '--fmad', // nvcc
  '--test-dir', '--output-on-failure', '--install', '--prefix', '--component', // cmake, ctest
]);

// ---- the documents ------------------------------------------------------------------------------------
const problems = [];
for (const f of files) {
  const lines = readFileSync(path.join(src, f), 'utf8').split('\n');
  let inCode = false;
  for (let i = 0; i < lines.length; i++) {
    let line = lines[i];
    const where = `${f}:${i + 1}`;
    if (/^\s*```/.test(line)) {
      inCode = !inCode;
      continue;
    }
    checkPaths(where, line, problems);
    if (inCode) {
      // a command continued with a backslash
      while (/\\$/.test(line) && i + 1 < lines.length) line = line.slice(0, -1) + ' ' + lines[++i];
      checkCommand(where, ' ' + line.replace(/^\s*\$\s*/, ''), problems);
    } else {
      for (const m of line.matchAll(/`([^`]+)`/g)) {
        checkCommand(where, ' ' + m[1], problems);
        // a flag on its own (`--workers`, `--busy-wait-ms 0`): some program's, or another tool's
        const lone = m[1].match(/^(--[a-z0-9][a-z0-9-]*)/);
        if (lone) {
          checked++;
          if (!anyFlag.has(lone[1]) && !OTHER_FLAGS.has(lone[1])) {
            problems.push(`${where}: ${lone[1]} is no program's flag (nor in OTHER_FLAGS)`);
          }
        }
      }
    }
  }
}
// the build files name only files that exist (their comments included)
const buildFiles = only.length ? [] : tree.filter((f) => /(^|\/)CMakeLists\.txt$|\.cmake$/.test(f));
for (const f of buildFiles) {
  readFileSync(path.join(src, f), 'utf8').split('\n')
    .forEach((line, i) => checkPaths(`${f}:${i + 1}`, line, problems));
}
for (const p of problems) console.error(p);
console.log(`test_docs: ${files.length} documents and ${buildFiles.length} build files, ` +
  `${checked} program flags looked up, ` +
  `${problems.length} mismatches`);
process.exit(problems.length ? 1 : 0);
