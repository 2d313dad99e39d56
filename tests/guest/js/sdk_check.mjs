import { Sandbox } from 'e2b'
const url = process.argv[2]
const dir = process.argv[3]
const sbx = new Sandbox({ sandboxId: 'sbx-js', sandboxUrl: url, envdVersion: '0.6.4', apiKey: 'unused', envdAccessToken: undefined })
const out = []
const r = await sbx.commands.run('echo js-hello; whoami')
out.push(['run', r.exitCode, r.stdout])
try { await sbx.commands.run('exit 4') } catch (e) { out.push(['exit', e.exitCode]) }
const bg = await sbx.commands.run('sleep 30', { background: true })
out.push(['list', (await sbx.commands.list()).some(p => p.pid === bg.pid)])
out.push(['kill', await sbx.commands.kill(bg.pid)])
await sbx.files.write(dir + '/js.txt', 'from js')
out.push(['read', await sbx.files.read(dir + '/js.txt')])
out.push(['list', (await sbx.files.list(dir)).map(e => e.name).join(',')])
out.push(['exists', await sbx.files.exists(dir + '/nope')])
out.push(['mkdir', await sbx.files.makeDir(dir + '/d1')])
const events = []
const w = await sbx.files.watchDir(dir, (e) => events.push(e.name + ':' + e.type))
await sbx.files.write(dir + '/w.txt', 'x')
await new Promise(r => setTimeout(r, 500))
await w.stop()
out.push(['watch', events.includes('w.txt:create')])
let ptyOut = ''
const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { ptyOut += new TextDecoder().decode(d) } })
await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('echo pty-$((2+3)); exit\n'))
await pty.wait().catch(() => {})
out.push(['pty', ptyOut.includes('pty-5')])
console.log(JSON.stringify(out))
