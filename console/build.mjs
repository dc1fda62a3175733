// Bundles the console from src/ (with xterm.js from node_modules) into OUTDIR:
// index.html, app.js and app.css. crates/space/build.rs runs it and embeds OUTDIR.
//   node build.mjs OUTDIR
import { build } from "esbuild";
import { copyFile, mkdir } from "node:fs/promises";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = process.argv[2];
if (!out) {
  console.error("usage: node build.mjs OUTDIR");
  process.exit(2);
}
await mkdir(out, { recursive: true });
await build({
  entryPoints: { app: join(here, "src/main.js") },
  bundle: true,
  format: "esm",
  target: "es2020",
  minify: true,
  legalComments: "eof",
  outdir: out,
  logLevel: "warning",
});
await copyFile(join(here, "src/index.html"), join(out, "index.html"));
