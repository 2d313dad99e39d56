// The E2B JS SDK quickstart against an aenv node, driven only by environment variables
// (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY). Prints one JSON line of [check, value] pairs.
import { Sandbox, NotFoundError, SandboxError } from 'e2b'

const out = []
const sbx = await Sandbox.create({ metadata: { lang: 'js' }, envs: { FROM_JS: 'yes' } })
try {
  const r = await sbx.commands.run('echo hi $FROM_JS')
  out.push(['run', r.exitCode, r.stdout])
  await sbx.files.write('/home/user/js.txt', 'written by the js sdk')
  out.push(['read', await sbx.files.read('/home/user/js.txt')])
  // a streamed (chunked, no Content-Length) upload
  const big = new Uint8Array(3 * 1024 * 1024).map((_, i) => i % 251)
  await sbx.files.write('/home/user/big.bin', new Blob([big]))
  const back = await sbx.files.read('/home/user/big.bin', { format: 'bytes' })
  out.push(['big', back.length === big.length && back.every((v, i) => v === big[i])])
  // WatchDir is a server stream through the node's proxy
  const events = []
  const w = await sbx.files.watchDir('/home/user', (e) => events.push(`${e.name}:${e.type}`))
  await sbx.files.write('/home/user/watched.txt', 'x')
  for (let i = 0; i < 50 && !events.includes('watched.txt:create'); i++) await new Promise(r => setTimeout(r, 100))
  await w.stop()
  out.push(['watch', events.includes('watched.txt:create')])
  const listed = await Sandbox.list({ query: { metadata: { lang: 'js' } } }).nextItems()
  out.push(['list', listed.some(s => s.sandboxId === sbx.sandboxId)])
  // the error code is read from the JSON body
  try {
    await Sandbox.connect('inotthere')
    out.push(['connect-missing', 'no error'])
  } catch (e) {
    out.push(['connect-missing', e instanceof NotFoundError || e instanceof SandboxError, String(e.message)])
  }
} finally {
  out.push(['kill', await sbx.kill()])
}
out.push(['killed-listed', (await Sandbox.list().nextItems()).some(s => s.sandboxId === sbx.sandboxId)])
console.log(JSON.stringify(out))
