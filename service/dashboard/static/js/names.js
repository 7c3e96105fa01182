// Spec names and dim names for list pages. Jobs and kernels store shapes and tile configs under
// canonical dim names (d0, d1, ...); pages show the names of the spec as first stored.
import { api } from "./api.js";

const cache = new Map(); // spec hash -> {name, dims: {d0: "m", ...}}

export async function lookupSpecs(hashes) {
  const missing = [...new Set(hashes)].filter((h) => h && !cache.has(h)).slice(0, 200);
  if (!missing.length) return;
  const q = new URLSearchParams();
  for (const h of missing) q.append("hash", h);
  try {
    const data = await api(`v1/dashboard/specs?${q}`);
    for (const [h, v] of Object.entries(data.specs || {})) cache.set(h, v);
  } catch (err) {
    console.warn("spec names unavailable", err);
  }
}

export function specName(hash) {
  const entry = cache.get(hash);
  return entry ? entry.name : null;
}

function rename(hash, obj) {
  const dims = (cache.get(hash) || {}).dims || {};
  const out = {};
  for (const [k, v] of Object.entries(obj)) out[dims[k] ?? k] = v;
  return out;
}

export function displayShape(hash, shape) {
  if (!shape || typeof shape !== "object") return shape;
  return rename(hash, shape);
}

export function displayConfig(hash, config) {
  if (!config || typeof config !== "object" || !config.blocks || typeof config.blocks !== "object") return config;
  return { ...config, blocks: rename(hash, config.blocks) };
}
