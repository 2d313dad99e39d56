// The E2B JS SDK's Template builder against an aenv node (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY):
// FROM an image in the test's registry, COPY from a build context, RUN, a start command and its ready check,
// then a sandbox of it. Prints one JSON line of [check, value] pairs.
// usage: node template_build.mjs <image> <context dir> <template name>
import { Sandbox, Template, waitForFile } from 'e2b'
import { mkdirSync, writeFileSync } from 'node:fs'

const [image, context, name] = process.argv.slice(2)
mkdirSync(`${context}/app`, { recursive: true })
writeFileSync(`${context}/app/hello.txt`, 'copied by the js sdk\n')

const out = []
const logs = []
const template = Template({ fileContextPath: context })
  .fromImage(image)
  .copy('app/', '/app/')
  .runCmd('echo js-built > /app/built.txt')
  .setEnvs({ FROM_JS_TEMPLATE: 'yes' })
  .setStartCmd('httpd -f -p 8081 -h /app', waitForFile('/app/built.txt'))
const info = await Template.build(template, name, { onBuildLogs: (e) => logs.push(e.message) })
out.push(['built', typeof info.buildId === 'string' && info.buildId.length > 0])
out.push(['logs', logs.some(l => l.includes('step 1/3 COPY')) && logs.some(l => l.includes('snapshotting'))])
out.push(['exists', await Template.exists(name)])
const sbx = await Sandbox.create(name)
try {
  out.push(['files', await sbx.files.read('/app/hello.txt'), await sbx.files.read('/app/built.txt')])
  out.push(['env', (await sbx.commands.run('echo $FROM_JS_TEMPLATE')).stdout])
  // the start command was running when the template was snapshotted
  out.push(['server', (await sbx.commands.run('wget -q -O - http://127.0.0.1:8081/hello.txt')).stdout])
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
