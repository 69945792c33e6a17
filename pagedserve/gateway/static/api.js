// The API key and the calls to this origin's API. The key lives in sessionStorage only:
// it goes when the tab closes, and no other tab or later visit sees it.
const KEY = "pagedserve.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export function headers(json = false) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// An error the API answered in OpenAI's shape, or a network failure.
export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export async function errorOf(response) {
  let message = response.status + " " + response.statusText, code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch (_) { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message, code);
}

export async function getJson(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}
