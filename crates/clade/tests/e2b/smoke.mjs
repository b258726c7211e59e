// The official e2b JS SDK against clade serve (env: E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL, E2B_TEMPLATE).
// Run with NODE_PATH pointing at the node_modules holding `e2b`.
import { createRequire } from 'node:module'
const require = createRequire(process.env.NODE_PATH + '/')
const { Sandbox } = require('e2b')

function check(name, cond, detail = '') {
  console.log((cond ? 'ok   ' : 'FAIL ') + name + (detail ? ': ' + detail : ''))
  if (!cond) process.exit(1)
}

const sbx = await Sandbox.create(process.env.E2B_TEMPLATE || 'base', { timeoutMs: 120_000 })
const r = await sbx.commands.run('echo hi')
check('create + run', r.stdout === 'hi\n' && r.exitCode === 0, JSON.stringify(r))
const chunks = []
await sbx.commands.run('for i in 1 2 3; do echo l$i; sleep 0.1; done', { onStdout: (d) => chunks.push(d) })
check('stream output', chunks.join('') === 'l1\nl2\nl3\n', JSON.stringify(chunks))
await sbx.files.write('/tmp/js.txt', 'from js')
check('files', (await sbx.files.read('/tmp/js.txt')) === 'from js')
const names = (await sbx.files.list('/tmp')).map((e) => e.name)
check('list', names.includes('js.txt'), names.join(','))
check('kill', (await sbx.kill()) !== false)
console.log('all passed')
