// E2B's JS code interpreter SDK (`@e2b/code-interpreter`, pinned by
// scripts/test-clients.sh) against space, unmodified: its default template, runCode
// with callbacks and a timeout, and its context calls.
//
// Run as `node crates/space/tests/e2b/code_interpreter.mjs` with E2B_NODE_MODULES,
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY (see sdk.mjs). Prints `ok <check>` per
// check; on the first failure prints the stack and exits 1. The sandbox it created is
// killed on the way out.
import { pathToFileURL } from 'node:url'

const modules = process.env.E2B_NODE_MODULES
if (!modules) {
  console.error('E2B_NODE_MODULES is not set (target/test-clients/node/node_modules)')
  process.exit(2)
}
const { Sandbox } = await import(
  pathToFileURL(`${modules}/@e2b/code-interpreter/dist/index.mjs`).href
)

const DEADLINE_S = Number(process.env.SPACE_E2B_DEADLINE || '240')
const ok = (name) => console.log(`ok ${name}`)
function check(cond, msg) {
  if (!cond) throw new Error(`check failed: ${msg}`)
}

let sbx
const watchdog = setTimeout(async () => {
  console.log(`FAIL watchdog: still running after ${DEADLINE_S} s`)
  if (sbx) await sbx.kill().catch(() => {})
  process.exit(1)
}, DEADLINE_S * 1000)

async function main() {
  sbx = await Sandbox.create({ timeoutMs: 600_000 })
  ok('Sandbox.create with the default template')

  const out = []
  const results = []
  let ex = await sbx.runCode("x = 41\nprint('hello')\nx + 1", {
    onStdout: (m) => out.push(m.line),
    onResult: (r) => results.push(r),
  })
  check(ex.text === '42', `text ${JSON.stringify(ex)}`)
  check(ex.logs.stdout.join('') === 'hello\n', `logs ${JSON.stringify(ex.logs)}`)
  check(out.join('') === 'hello\n' && results.length === 1, `callbacks ${out} ${results.length}`)
  ok('runCode: stdout, the main result, callbacks')

  ex = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()')
  const png = ex.results.find((r) => r.png)?.png
  check(png && Buffer.from(png, 'base64').subarray(0, 8).equals(
    Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])), 'no PNG')
  ex = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
  check(ex.results[0].html?.includes('<table') && ex.results[0].text, 'dataframe')
  ok('a chart as a PNG, a DataFrame as text and HTML')

  ex = await sbx.runCode('1 / 0')
  check(ex.error?.name === 'ZeroDivisionError' && ex.error.traceback.includes('ZeroDivisionError'),
    `error ${JSON.stringify(ex.error)}`)
  ok('an exception comes back as an error')

  let timedOut = false
  try {
    await sbx.runCode('while True: pass', { timeoutMs: 3000 })
  } catch (e) {
    timedOut = e?.name === 'TimeoutError' || /timed out/i.test(e?.message ?? '')
    if (!timedOut) throw e
  }
  check(timedOut, 'no timeout')
  ex = await sbx.runCode('x')
  check(ex.text === '41', `after the timeout ${JSON.stringify(ex)}`)
  ok('a timeout interrupts; the next cell works')

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  check(ctx.cwd === '/tmp' && ctx.language === 'python', `context ${JSON.stringify(ctx)}`)
  ex = await sbx.runCode('y = 2\ny', { context: ctx })
  check(ex.text === '2', 'in the context')
  ex = await sbx.runCode('y')
  check(ex.error?.name === 'NameError', 'contexts share state')
  const ids = (await sbx.listCodeContexts()).map((c) => c.id)
  check(ids.includes(ctx.id), `list ${ids}`)
  await sbx.restartCodeContext(ctx)
  ex = await sbx.runCode('y', { context: ctx })
  check(ex.error?.name === 'NameError', 'restart kept state')
  await sbx.removeCodeContext(ctx)
  let gone = false
  try {
    await sbx.runCode('1', { context: ctx })
  } catch (e) {
    // By name: the SDK's error classes come from its own import of `e2b`.
    gone = e?.name === 'NotFoundError'
    if (!gone) throw e
  }
  check(gone, 'a removed context ran')
  ok('contexts: create, list, restart, remove')

  ex = await sbx.runCode('echo from-bash', { language: 'bash' })
  check(ex.logs.stdout.join('') === 'from-bash\n', `bash ${JSON.stringify(ex.logs)}`)
  let refused = false
  try {
    await sbx.runCode('1', { language: 'r' })
  } catch (e) {
    refused = e?.name === 'SandboxError' && /400/.test(e.message)
    if (!refused) throw e
  }
  check(refused, 'r ran')
  ok('bash runs; an unknown language is refused')
}

let code = 0
try {
  await main()
  console.log('all ok')
} catch (e) {
  console.log(e?.stack ?? String(e))
  code = 1
} finally {
  clearTimeout(watchdog)
  if (sbx) await sbx.kill().catch((e) => console.error(`cleanup: ${e}`))
}
process.exit(code)
