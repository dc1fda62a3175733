// The E2B JS SDK (pinned by scripts/test-clients.sh) against space's
// E2B-compatible API, used exactly as an application would use it.
//
// Run as `node crates/space/tests/e2b/sdk.mjs` with
//   E2B_NODE_MODULES  absolute path of target/test-clients/node/node_modules
//   E2B_API_URL, E2B_SANDBOX_URL  the server (both the same http://127.0.0.1:PORT)
//   E2B_API_KEY       tenant A's key
//   SPACE_OTHER_KEY   tenant B's key
//   SPACE_TEMPLATE    template for Sandbox.create (default "base")
//   SPACE_E2B_DEADLINE  seconds before the watchdog gives up (default 170)
// Prints `ok <check>` per check; on the first failure prints the stack and
// exits 1. Every sandbox it created is killed on the way out.

import { randomBytes, randomUUID } from 'node:crypto'
import { pathToFileURL } from 'node:url'

const modules = process.env.E2B_NODE_MODULES
if (!modules) {
  console.error('E2B_NODE_MODULES is not set (target/test-clients/node/node_modules)')
  process.exit(2)
}
const {
  Sandbox,
  AuthenticationError,
  CommandExitError,
  FileType,
  FilesystemEventType,
  NotFoundError,
  SandboxError,
  TimeoutError,
} = await import(pathToFileURL(`${modules}/e2b/dist/index.mjs`).href)

const TEMPLATE = process.env.SPACE_TEMPLATE || 'base'
const API_KEY = process.env.E2B_API_KEY
const OTHER_KEY = process.env.SPACE_OTHER_KEY
const SANDBOX_URL = process.env.E2B_SANDBOX_URL.replace(/\/+$/, '')
const DEADLINE_S = Number(process.env.SPACE_E2B_DEADLINE || '170')
const SUITE = `js-${randomUUID().slice(0, 12)}`

const created = [] // [sandboxId, apiKey]

const ok = (name) => console.log(`ok ${name}`)

function check(cond, msg) {
  if (!cond) throw new Error(`check failed: ${msg}`)
}

async function rejects(cls, promiseOrFn) {
  let result
  try {
    result = await (typeof promiseOrFn === 'function' ? promiseOrFn() : promiseOrFn)
  } catch (e) {
    if (e instanceof cls) return e
    throw new Error(`expected ${cls.name}, got ${e?.constructor?.name}: ${e?.message}`, { cause: e })
  }
  throw new Error(`expected ${cls.name}, got result ${JSON.stringify(result)}`)
}

async function create(opts = {}) {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000, ...opts })
  created.push([sbx.sandboxId, opts.apiKey ?? API_KEY])
  return sbx
}

async function cleanup() {
  while (created.length) {
    const [id, apiKey] = created.pop()
    try {
      await Sandbox.kill(id, { apiKey, requestTimeoutMs: 20_000 })
    } catch (e) {
      console.error(`cleanup: kill ${id}: ${e}`)
    }
  }
}

async function listAll(opts) {
  const paginator = Sandbox.list(opts)
  const items = []
  while (paginator.hasNext) items.push(...(await paginator.nextItems()))
  return items
}

function envdList(sandboxId, token) {
  const headers = {
    'E2b-Sandbox-Id': sandboxId,
    'E2b-Sandbox-Port': '49983',
    'Content-Type': 'application/json',
  }
  if (token !== undefined) headers['X-Access-Token'] = token
  return fetch(`${SANDBOX_URL}/process.Process/List`, {
    method: 'POST',
    headers,
    body: '{}',
    signal: AbortSignal.timeout(20_000),
  })
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const enc = new TextEncoder()
const ids = (list) => list.map((s) => s.sandboxId).sort()

async function commandsChecks(sbx) {
  const c = sbx.commands

  let r = await c.run('true')
  check(r.exitCode === 0 && r.stdout === '', `run true: ${JSON.stringify(r)}`)
  ok('commands.run true exit 0')

  const e = await rejects(CommandExitError, c.run('echo hi; echo err >&2; exit 3'))
  check(e.exitCode === 3 && e.stdout === 'hi\n' && e.stderr === 'err\n',
    `exit error ${e.exitCode} ${JSON.stringify(e.stdout)} ${JSON.stringify(e.stderr)}`)
  ok('commands.run nonzero exit rejects with CommandExitError')

  r = await c.run('echo $A', { envs: { A: '1' } })
  check(r.stdout === '1\n', `envs ${JSON.stringify(r.stdout)}`)
  r = await c.run('echo $SBX_ENV')
  check(r.stdout === 'from-create\n', `sandbox envs ${JSON.stringify(r.stdout)}`)
  r = await c.run('pwd', { cwd: '/tmp' })
  check(r.stdout === '/tmp\n', `cwd ${JSON.stringify(r.stdout)}`)
  r = await c.run('id -u', { user: 'root' })
  check(r.stdout === '0\n', `user ${JSON.stringify(r.stdout)}`)
  ok('commands.run envs / create envs / cwd / user')

  // Streamed, shown by cause rather than by timing: the command prints 1 and then waits
  // for a file that this callback writes only once it has that 1. Output that came all at
  // once at the end could never let it go on (it gives up after 60 s and says so).
  const chunks = []
  const errs = []
  const go = `/tmp/go-${randomUUID()}`
  let wrote = null
  r = await c.run(
    `echo 1; echo e1 >&2; i=0; while [ ! -e ${go} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; ` +
      `[ -e ${go} ] || echo unstreamed; for i in 2 3; do echo $i; echo e$i >&2; done`,
    {
      onStdout: (s) => {
        chunks.push(s)
        if (wrote === null && chunks.join('').includes('1\n')) wrote = sbx.files.write(go, '')
      },
      onStderr: (s) => errs.push(s),
      timeoutMs: 120_000,
    },
  )
  await wrote
  check(chunks.join('') === '1\n2\n3\n', `output was not streamed, or not all of it came: ${JSON.stringify(chunks)}`)
  check(errs.join('') === 'e1\ne2\ne3\n', `onStderr ${JSON.stringify(errs)}`)
  ok('commands.run onStdout/onStderr stream')

  let h = await c.run('sleep 30', { background: true })
  check(Number.isInteger(h.pid) && h.pid > 0, `pid ${h.pid}`)
  const procs = await c.list()
  const proc = procs.find((p) => p.pid === h.pid)
  check(proc, `pid ${h.pid} not in commands.list() ${JSON.stringify(procs)}`)
  check(proc.args.at(-1) === 'sleep 30', `ProcessInfo ${JSON.stringify(proc)}`)
  check((await c.kill(h.pid)) === true, 'commands.kill false')
  const ke = await rejects(CommandExitError, h.wait())
  check(ke.exitCode !== 0, `killed exit code ${ke.exitCode}`)
  check((await c.kill(999999)) === false, 'kill unknown pid')
  ok('background command: list, kill, wait rejects; kill unknown false')

  r = await (await c.run('sleep 1; echo done', { background: true })).wait()
  check(r.stdout === 'done\n', `background wait ${JSON.stringify(r)}`)
  ok('background command wait()')

  h = await c.run('cat', { background: true, stdin: true, timeoutMs: 30_000 })
  await c.sendStdin(h.pid, 'hello\n')
  await c.closeStdin(h.pid)
  r = await h.wait()
  check(r.stdout === 'hello\n', `stdin ${JSON.stringify(r.stdout)}`)
  ok('commands.sendStdin / closeStdin')

  h = await c.run('for i in 1 2 3 4 5 6 7 8; do echo line$i; sleep 0.25; done', { background: true })
  const pid = h.pid
  await h.disconnect()
  await sleep(400)
  const later = []
  const h2 = await c.connect(pid, { onStdout: (s) => later.push(s), timeoutMs: 30_000 })
  r = await h2.wait()
  check(r.exitCode === 0 && r.stdout.includes('line8\n'), `connect ${JSON.stringify(r)}`)
  check(later.join('').includes('line8\n'), `connect onStdout ${JSON.stringify(later)}`)
  ok('disconnect keeps the command; commands.connect gets its later output')

  const data = []
  h = await sbx.pty.create({ rows: 24, cols: 80, onData: (d) => data.push(Buffer.from(d)), timeoutMs: 30_000 })
  await sbx.pty.sendInput(h.pid, enc.encode('echo pty-$((40+2))\n'))
  for (let i = 0; i < 50 && !Buffer.concat(data).includes('pty-42'); i++) await sleep(100)
  check(Buffer.concat(data).includes('pty-42'), `pty output ${Buffer.concat(data)}`)
  await sbx.pty.resize(h.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(h.pid, enc.encode('stty size; exit\n'))
  r = await h.wait()
  check(Buffer.concat(data).toString().includes('30 100'), `pty size ${Buffer.concat(data)}`)
  check(r.exitCode === 0, `pty exit ${r.exitCode}`)
  ok('pty create / sendInput / resize / exit')

  // Ended by the timeout, not by the program (which would take 300 s): a bound with room
  // for a loaded host.
  const start = Date.now()
  await rejects(TimeoutError, c.run('sleep 300', { timeoutMs: 1000 }))
  check(Date.now() - start < 120_000, 'the timeout did not end the command')
  ok('commands.run timeoutMs rejects with TimeoutError')
}

async function filesChecks(sbx) {
  const f = sbx.files

  const info = await f.write('/tmp/a/b/c.txt', 'x')
  check(info.path === '/tmp/a/b/c.txt' && info.name === 'c.txt', `write info ${JSON.stringify(info)}`)
  check((await f.read('/tmp/a/b/c.txt')) === 'x', 'read back')
  ok('files.write creates parents; read')

  const bin = new Uint8Array(256 * 1000)
  for (let i = 0; i < bin.length; i++) bin[i] = i % 256
  await f.write('/tmp/bin.dat', bin.buffer)
  const binBack = await f.read('/tmp/bin.dat', { format: 'bytes' })
  check(Buffer.compare(Buffer.from(binBack), Buffer.from(bin)) === 0, `binary ${binBack.length} bytes`)
  ok('files binary round trip')

  const infos = await f.write([
    { path: '/tmp/m/1.txt', data: 'one' },
    { path: '/tmp/m/2.txt', data: 'two' },
  ])
  check(Array.isArray(infos) && infos.length === 2, `write list ${JSON.stringify(infos)}`)
  check((await f.read('/tmp/m/2.txt')) === 'two', 'write list content')
  ok('files.write with a list of files')

  const big = randomBytes(5 * 1024 * 1024)
  await f.write('/tmp/big1.bin', big.buffer.slice(big.byteOffset, big.byteOffset + big.length))
  let back = await f.read('/tmp/big1.bin', { format: 'bytes' })
  check(Buffer.compare(Buffer.from(back), big) === 0, '5 MiB multipart')
  await f.write('/tmp/big2.bin', new Blob([big]).stream()) // streamed octet-stream
  back = await f.read('/tmp/big2.bin', { format: 'bytes' })
  check(Buffer.compare(Buffer.from(back), big) === 0, '5 MiB stream')
  ok('files 5 MiB upload (multipart and stream) reads back identical')

  await f.write('/tmp/l/f1.txt', '12345')
  await f.write('/tmp/l/sub/f2.txt', 'z')
  const entries = Object.fromEntries((await f.list('/tmp/l')).map((e) => [e.name, e]))
  check(Object.keys(entries).sort().join() === 'f1.txt,sub', `list ${Object.keys(entries)}`)
  check(entries['f1.txt'].type === FileType.FILE && entries.sub.type === FileType.DIR, 'list types')
  const deep = (await f.list('/tmp/l', { depth: 2 })).map((e) => e.path)
  check(deep.includes('/tmp/l/sub/f2.txt'), `list depth 2 ${deep}`)
  ok('files.list (depth 1 and 2)')

  const st = await f.getInfo('/tmp/l/f1.txt')
  check(st.type === FileType.FILE && st.size === 5, `getInfo ${JSON.stringify(st)}`)
  await f.rename('/tmp/l/f1.txt', '/tmp/l/g1.txt')
  check((await f.exists('/tmp/l/g1.txt')) && !(await f.exists('/tmp/l/f1.txt')), 'rename')
  await f.remove('/tmp/l/g1.txt')
  check(!(await f.exists('/tmp/l/g1.txt')), 'remove')
  check((await f.makeDir('/tmp/md')) === true, 'makeDir new')
  check((await f.makeDir('/tmp/md')) === false, 'makeDir existing')
  ok('files getInfo / rename / exists / remove / makeDir')

  await rejects(NotFoundError, f.read('/nope/missing.txt'))
  await rejects(NotFoundError, f.list('/nope'))
  await rejects(NotFoundError, f.getInfo('/nope'))
  ok('files not found reject with NotFoundError')

  await f.makeDir('/tmp/w')
  const events = []
  const w = await f.watchDir('/tmp/w', (e) => events.push(e), { timeoutMs: 60_000 })
  try {
    await f.write('/tmp/w/new.txt', 'hi')
    const seen = () => events.some((e) => e.name.endsWith('new.txt') &&
      (e.type === FilesystemEventType.CREATE || e.type === FilesystemEventType.WRITE))
    for (let i = 0; i < 100 && !seen(); i++) await sleep(100)
    check(seen(), `no CREATE/WRITE event for new.txt: ${JSON.stringify(events)}`)
  } finally {
    await w.stop()
  }
  ok('files.watchDir events')
}

async function lifecycleAndSecurity(sbx, sbx2, other) {
  const suite = { query: { metadata: { suite: SUITE } } }
  check(ids(await listAll(suite)).join() === [sbx.sandboxId, sbx2.sandboxId].sort().join(),
    'list by suite')
  const p = Sandbox.list({ ...suite, limit: 1 })
  const page1 = await p.nextItems()
  check(page1.length === 1 && p.hasNext, `page 1 ${JSON.stringify(page1)}`)
  const page2 = await p.nextItems()
  check(page2.length === 1 && page2[0].sandboxId !== page1[0].sandboxId, `page 2 ${JSON.stringify(page2)}`)
  const one = await listAll({ query: { metadata: { suite: SUITE, n: '1' } } })
  check(ids(one).join() === sbx.sandboxId, `n=1 ${ids(one)}`)
  ok('Sandbox.list metadata filter and pagination')

  const info = await sbx.getInfo()
  check(info.sandboxId === sbx.sandboxId && info.metadata.suite === SUITE, `getInfo ${JSON.stringify(info)}`)
  check(info.state === 'running' && info.cpuCount >= 1 && info.memoryMB >= 1, `getInfo ${JSON.stringify(info)}`)
  check(Boolean(info.templateId) && info.endAt > info.startedAt, `getInfo ${JSON.stringify(info)}`)
  await sbx.setTimeout(900_000)
  const after = await sbx.getInfo()
  check(after.endAt - after.startedAt > 800_000, `setTimeout: ${after.startedAt} .. ${after.endAt}`)
  check((await sbx.isRunning()) === true, 'isRunning')
  ok('getInfo / setTimeout / isRunning')

  // security, while everything runs
  const token = sbx.envdAccessToken
  check(typeof token === 'string' && token.length > 0, `no envd access token ${token}`)
  let res = await envdList(sbx.sandboxId, 'wrong')
  check(res.status === 401, `wrong token ${res.status}`)
  res = await envdList(sbx.sandboxId, undefined)
  check(res.status === 401, `missing token ${res.status}`)
  res = await envdList(sbx.sandboxId, token)
  check(res.status === 200, `right token ${res.status}`)
  res = await envdList(other.sandboxId, token)
  check(res.status >= 400 && res.status < 500, `A's token on B's sandbox ${res.status}`)
  res = await envdList(other.sandboxId, other.envdAccessToken)
  check(res.status === 200, `B's own token ${res.status}`)
  ok('envd access token: wrong/missing/another sandbox\'s refused, right one accepted')

  await rejects(NotFoundError, Sandbox.connect(sbx.sandboxId, { apiKey: OTHER_KEY }))
  await rejects(NotFoundError, Sandbox.getInfo(sbx.sandboxId, { apiKey: OTHER_KEY }))
  check((await Sandbox.kill(sbx.sandboxId, { apiKey: OTHER_KEY })) === false, 'B killed A\'s sandbox')
  check(await sbx.isRunning(), 'A\'s sandbox after B\'s kill')
  check((await listAll({ ...suite, apiKey: OTHER_KEY })).length === 0, 'B sees A\'s sandboxes')
  check(ids(await listAll({ query: { metadata: { suite: `${SUITE}-b` } }, apiKey: OTHER_KEY })).join() ===
    other.sandboxId, 'B\'s own list')
  check((await listAll({ query: { metadata: { suite: `${SUITE}-b` } } })).length === 0, 'A sees B\'s sandboxes')
  await rejects(AuthenticationError, listAll({ apiKey: 'space-wrong-key' }))
  ok('another tenant: connect/getInfo NotFoundError, kill false, list per tenant; wrong key refused')

  // pause / resume on sbx2
  await sbx2.files.write('/tmp/persist.txt', 'kept')
  const h = await sbx2.commands.run('sleep 600', { background: true, timeoutMs: 0 })
  const pid = h.pid
  await h.disconnect()
  check((await sbx2.pause()) === true, 'pause false')
  check((await Sandbox.getInfo(sbx2.sandboxId)).state === 'paused', 'state after pause')
  const paused = await listAll({ query: { metadata: { suite: SUITE }, state: ['paused'] } })
  check(ids(paused).join() === sbx2.sandboxId, `state filter ${ids(paused)}`)
  ok('pause; state paused; list state filter')
  const resumed = await Sandbox.connect(sbx2.sandboxId)
  check((await resumed.files.read('/tmp/persist.txt')) === 'kept', 'file after resume')
  check((await resumed.commands.list()).some((p) => p.pid === pid), 'process after resume')
  check((await resumed.getInfo()).state === 'running', 'state after connect')
  ok('Sandbox.connect resumes: files and processes kept')

  check((await resumed.kill()) === true, 'kill false')
  await rejects(NotFoundError, Sandbox.getInfo(sbx2.sandboxId))
  await rejects(NotFoundError, Sandbox.connect(sbx2.sandboxId))
  check((await Sandbox.kill(sbx2.sandboxId)) === false, 'second kill')
  check((await sbx2.isRunning()) === false, 'isRunning after kill')
  await rejects(SandboxError, sbx2.commands.run('true'))
  ok('kill; getInfo/connect NotFoundError; kill again false; isRunning false')
}

async function main() {
  try {
    const sbx = await create({ metadata: { suite: SUITE, n: '1' }, envs: { SBX_ENV: 'from-create' } })
    const sbx2 = await create({ metadata: { suite: SUITE, n: '2' } })
    const other = await create({ metadata: { suite: `${SUITE}-b` }, apiKey: OTHER_KEY })
    ok('Sandbox.create (two in tenant A, one in tenant B)')
    await commandsChecks(sbx)
    await filesChecks(sbx)
    await lifecycleAndSecurity(sbx, sbx2, other)
  } catch (e) {
    console.error(e?.stack ?? e)
    if (e?.cause) console.error('cause:', e.cause?.stack ?? e.cause)
    return 1
  } finally {
    await cleanup()
  }
  console.log('all ok')
  return 0
}

const watchdog = setTimeout(async () => {
  console.log(`FAIL watchdog: still running after ${DEADLINE_S} s`)
  await cleanup()
  process.exit(1)
}, DEADLINE_S * 1000)

const code = await main()
clearTimeout(watchdog)
process.exit(code)
