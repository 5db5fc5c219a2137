"use strict";
// The demo page: POST v1/tts (streamed or whole), played piece by piece with the Web Audio API and drawn as a
// waveform as it arrives; "speak as I type" over the text stream WebSocket (v1/audio/speech/stream); voices
// registered from a file or the microphone (POST/DELETE v1/voices); an API key kept in local storage and sent as a
// bearer token. URLs are relative so that the page also works under a route prefix ending in "/".

const PIECEWISE_FORMATS = ["wav", "pcm"]; // decoded here piece by piece; the others by the browser, once received
const KEY_STORAGE = "cosyvoice-api-key";
const BYTES_PER_SAMPLE = 2; // the stream is 16-bit little-endian mono
const PCM_SCALE = 32768;
// Network pieces can be a few hundred bytes: merging them means fewer buffer edges to schedule.
const MIN_BLOCK_SAMPLES = 2048;
// Slack for the first block, so that it is not scheduled in the past while the main thread is busy.
const START_LEAD_S = 0.05;

const byId = (id) => document.getElementById(id);
let serverInfo = null; // GET v1/voices: sample rate, voices, formats, what the model can do
let current = null; // {controller, player} of the latest request
let downloadUrl = null;

// --- bytes to samples ------------------------------------------------------------------------------

function concatBytes(parts) {
  const total = parts.reduce((sum, part) => sum + part.length, 0);
  const joined = new Uint8Array(total);
  let offset = 0;
  for (const part of parts) {
    joined.set(part, offset);
    offset += part.length;
  }
  return joined;
}

function fourCC(view, offset) {
  return String.fromCharCode(...new Uint8Array(view.buffer, view.byteOffset + offset, 4));
}

// {sampleRate, dataOffset} once `bytes` hold the WAV header up to the data chunk, else null.
function parseWavHeader(bytes) {
  if (bytes.length < 12) return null;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
  if (fourCC(view, 0) !== "RIFF" || fourCC(view, 8) !== "WAVE") throw new Error("the stream is not a WAV file");
  let sampleRate = null;
  let offset = 12;
  while (offset + 8 <= bytes.length) {
    const id = fourCC(view, offset);
    const size = view.getUint32(offset + 4, true);
    if (id === "data") {
      if (sampleRate === null) throw new Error("the WAV stream has no fmt chunk before its data");
      return { sampleRate, dataOffset: offset + 8 };
    }
    if (offset + 8 + size > bytes.length) return null;
    if (id === "fmt ") {
      const channels = view.getUint16(offset + 10, true);
      const bits = view.getUint16(offset + 22, true);
      if (channels !== 1 || bits !== 16) throw new Error(`cannot play ${bits}-bit ${channels}-channel WAV`);
      sampleRate = view.getUint32(offset + 12, true);
    }
    offset += 8 + size + (size % 2); // RIFF chunks are padded to even sizes
  }
  return null;
}

// Turns the response's bytes into float samples, piece by piece: reads the WAV header first when there is
// one, and keeps a sample split between two pieces for the next one.
class SampleDecoder {
  constructor(format, sampleRate) {
    this.awaitingHeader = format === "wav";
    this.sampleRate = sampleRate;
    this.dataOffset = 0;
    this.pending = new Uint8Array(0);
  }

  push(piece) {
    let bytes = concatBytes([this.pending, piece]);
    if (this.awaitingHeader) {
      const header = parseWavHeader(bytes);
      if (header === null) {
        this.pending = bytes;
        return new Float32Array(0);
      }
      this.awaitingHeader = false;
      this.sampleRate = header.sampleRate;
      this.dataOffset = header.dataOffset;
      bytes = bytes.subarray(header.dataOffset);
    }
    const usable = bytes.length - (bytes.length % BYTES_PER_SAMPLE);
    this.pending = bytes.slice(usable);
    const view = new DataView(bytes.buffer, bytes.byteOffset, usable);
    const samples = new Float32Array(usable / BYTES_PER_SAMPLE);
    for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(i * BYTES_PER_SAMPLE, true) / PCM_SCALE;
    return samples;
  }
}

// --- playback ----------------------------------------------------------------------------------------

// Schedules blocks of samples back to back on an AudioContext. Without an audio device (a headless
// browser, a locked-down machine) it only counts: the audio still arrives and can be downloaded.
class Player {
  constructor() {
    this.parts = [];
    this.partSamples = 0;
    this.nextStart = 0;
    this.scheduledSamples = 0;
    this.failure = null;
    try {
      this.context = new AudioContext();
    } catch (error) {
      this.disable(error);
    }
  }

  disable(error) {
    this.context?.close().catch(() => {});
    this.context = null;
    this.failure = error.message || String(error);
  }

  push(samples, sampleRate) {
    if (samples.length === 0) return;
    this.parts.push(samples);
    this.partSamples += samples.length;
    if (this.partSamples >= MIN_BLOCK_SAMPLES) this.flush(sampleRate);
  }

  flush(sampleRate) {
    if (this.partSamples === 0) return;
    const block = new Float32Array(this.partSamples);
    let offset = 0;
    for (const part of this.parts) {
      block.set(part, offset);
      offset += part.length;
    }
    this.parts = [];
    this.partSamples = 0;
    if (this.context === null) return;
    try {
      // A buffer at the stream's rate: the context resamples to the device's rate.
      const buffer = this.context.createBuffer(1, block.length, sampleRate);
      buffer.copyToChannel(block, 0);
      const source = this.context.createBufferSource();
      source.buffer = buffer;
      source.connect(this.context.destination);
      this.nextStart = Math.max(this.nextStart, this.context.currentTime + START_LEAD_S);
      source.start(this.nextStart);
      this.nextStart += buffer.duration;
      this.scheduledSamples += block.length;
    } catch (error) {
      this.disable(error);
    }
  }

  stop() {
    this.context?.close().catch(() => {});
    this.context = null;
  }
}

// --- waveform ------------------------------------------------------------------------------------------

// Draws the received audio as it arrives: one min/max bar per block of samples, the blocks so far spread over the
// whole canvas width (short or long), scaled to the loudest sample so far (quiet audio stays visible).
class Waveform {
  static BLOCK_SAMPLES = 256;

  constructor(canvas) {
    this.canvas = canvas;
    this.reset();
  }

  reset() {
    this.peaks = []; // [min, max] per block
    this.blockMin = Infinity;
    this.blockMax = -Infinity;
    this.blockFill = 0;
    this.samples = 0;
    this.loudest = 0;
    this.frame = null;
    this.draw();
  }

  push(samples) {
    for (const sample of samples) {
      this.blockMin = Math.min(this.blockMin, sample);
      this.blockMax = Math.max(this.blockMax, sample);
      if (++this.blockFill === Waveform.BLOCK_SAMPLES) this.closeBlock();
    }
    this.samples += samples.length;
    this.frame ??= requestAnimationFrame(() => this.draw());
  }

  closeBlock() {
    if (this.blockFill === 0) return;
    this.peaks.push([this.blockMin, this.blockMax]);
    this.loudest = Math.max(this.loudest, Math.abs(this.blockMin), Math.abs(this.blockMax));
    this.blockMin = Infinity;
    this.blockMax = -Infinity;
    this.blockFill = 0;
  }

  finish() {
    this.closeBlock();
    if (this.frame !== null) cancelAnimationFrame(this.frame);
    this.draw();
  }

  draw() {
    this.frame = null;
    const { width, height } = this.canvas;
    const context = this.canvas.getContext("2d");
    context.clearRect(0, 0, width, height);
    context.fillStyle = "#1e88e5";
    const step = width / Math.max(this.peaks.length, 1);
    const middle = height / 2;
    const scale = middle / Math.max(this.loudest, 1e-4);
    this.peaks.forEach(([low, high], index) => {
      context.fillRect(index * step, middle - high * scale, Math.max(step, 1), Math.max(1, (high - low) * scale));
    });
    this.canvas.dataset.drawnSamples = String(this.peaks.length === 0 ? 0 : this.samples);
    this.canvas.dataset.drawnWidth = String(this.peaks.length === 0 ? 0 : Math.round(this.peaks.length * step));
  }
}

const waveform = new Waveform(byId("waveform"));

// --- the page ----------------------------------------------------------------------------------------

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) ?? "";
}

// fetch() with the saved API key as a bearer token.
function api(path, options = {}) {
  const headers = { ...(options.headers ?? {}) };
  if (apiKey() !== "") headers.authorization = `Bearer ${apiKey()}`;
  return fetch(path, { ...options, headers });
}

function showError(message, box = byId("error")) {
  box.textContent = message;
  box.hidden = message === "";
}

function setStatus(state, text = state) {
  const status = byId("status");
  status.dataset.state = state;
  status.textContent = text;
}

function showPlayback(player) {
  const playback = byId("playback");
  playback.dataset.scheduledSamples = String(player.scheduledSamples);
  playback.textContent = player.failure === null ? "through the default audio output" : `unavailable (${player.failure})`;
}

// The message of an API error (OpenAI's shape: {"error": {"message": ...}}), else the HTTP status.
async function apiErrorMessage(response) {
  try {
    const body = await response.json();
    if (body?.error?.message) return body.error.message;
  } catch {
    // not JSON: fall back to the status line
  }
  return `HTTP ${response.status} ${response.statusText}`.trim();
}

function option(value, label = value) {
  const element = document.createElement("option");
  element.value = value;
  element.textContent = label;
  return element;
}

function fillSelect(select, values, labels = {}) {
  select.replaceChildren(...values.map((value) => option(value, labels[value] ?? value)));
}

// Built-in speakers, then registered voices; keeps the selection when it still exists.
function fillVoices(info) {
  const select = byId("voice");
  const previous = select.value;
  const builtIn = document.createElement("optgroup");
  builtIn.label = "built-in";
  builtIn.append(...info.voices.map((voice) => option(voice)));
  const registered = document.createElement("optgroup");
  registered.label = "registered";
  const label = (voice) => (voice.name === voice.id ? voice.id : `${voice.name} (${voice.id})`);
  registered.append(...info.registered_voices.map((voice) => option(voice.id, label(voice))));
  select.replaceChildren(builtIn, ...(info.registered_voices.length ? [registered] : []));
  if ([...select.options].some((item) => item.value === previous)) select.value = previous;
  fillRegisteredList(info.registered_voices);
  updateModeHint();
}

function fillRegisteredList(voices) {
  const list = byId("registered-voices");
  list.replaceChildren(
    ...voices.map((voice) => {
      const item = document.createElement("li");
      item.dataset.voiceId = voice.id;
      const label = document.createElement("span");
      label.textContent = `${voice.name} (${voice.duration_s.toFixed(1)} s): “${voice.transcript}”`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete-voice";
      remove.textContent = "Delete";
      remove.addEventListener("click", () => deleteVoice(voice.id));
      item.append(label, " ", remove);
      return item;
    }),
  );
  if (voices.length === 0) list.replaceChildren(Object.assign(document.createElement("li"), { textContent: "none yet" }));
}

async function loadVoices() {
  try {
    const response = await api("v1/voices");
    if (!response.ok) throw new Error(await apiErrorMessage(response));
    serverInfo = await response.json();
    updateInstructMode();
    fillVoices(serverInfo);
    fillFormats();
    byId("cloning-off").hidden = serverInfo.voice_cloning;
    byId("register").disabled = !serverInfo.voice_cloning;
    byId("voice").disabled = false;
    byId("speak").disabled = false;
    showError("");
    setStatus("ready");
  } catch (error) {
    showError(`could not load the voices: ${error.message}`);
    setStatus("error");
  }
}

// Every format the server writes; with streaming on, those it can stream (all but flac). wav and pcm play as they
// arrive; the encoded ones once the whole file is in (the browser decodes them).
function fillFormats() {
  const choices = byId("stream").checked ? serverInfo.stream_formats : serverInfo.formats;
  const select = byId("format");
  const previous = select.value;
  const labels = { pcm: "pcm (raw 16-bit mono)" };
  for (const name of choices) if (!PIECEWISE_FORMATS.includes(name)) labels[name] = `${name} (plays once received)`;
  const piecewise = PIECEWISE_FORMATS.filter((name) => choices.includes(name));
  fillSelect(select, [...piecewise, ...choices.filter((name) => !piecewise.includes(name))], labels);
  if (previous && [...select.options].some((item) => item.value === previous)) select.value = previous;
}

const isRegisteredVoice = (voice) => serverInfo?.registered_voices.some((record) => record.id === voice);

// Instruct mode only where the model follows instructions; the hint says why it is off.
function updateInstructMode() {
  const instructOption = byId("mode").querySelector('option[value="instruct"]');
  instructOption.disabled = serverInfo.instructions === "none";
  instructOption.textContent = instructOption.disabled ? "instruct (this model follows no instructions)" : "instruct";
  if (instructOption.disabled && byId("mode").value === "instruct") byId("mode").value = "zero-shot";
}

// What the chosen mode means with the chosen voice, and the instruction field for instruct mode.
function updateModeHint() {
  const mode = byId("mode").value;
  const instruct = mode === "instruct";
  byId("instruct").hidden = !instruct;
  byId("instruct-label").hidden = !instruct;
  const registered = isRegisteredVoice(byId("voice").value);
  const hints = {
    "zero-shot": registered
      ? "zero-shot: the recording's transcript and speech lead the synthesis"
      : "a built-in speaker: the model's own voice",
    "cross-lingual": "cross-lingual: only the timbre of a registered voice, for text in another language",
    instruct: `instruct: the model follows the instruction (this model: ${serverInfo?.instructions ?? "…"})`,
  };
  byId("mode-hint").textContent = hints[mode];
}

// The /v1/tts body of the form's settings.
function requestBody(format) {
  const body = {
    text: byId("text").value,
    voice: byId("voice").value,
    format,
    stream: byId("stream").checked,
    speed: Number(byId("speed").value),
  };
  const mode = byId("mode").value;
  if (mode === "cross-lingual") body.cross_lingual = true;
  if (mode === "instruct") body.instruct_text = byId("instruct").value;
  return body;
}

// The streamed WAV header has unknown (0xFFFFFFFF) sizes; a downloaded file gets the real ones.
function downloadableBytes(bytes, format, dataOffset) {
  if (format !== "wav") return bytes;
  const file = bytes.slice();
  const view = new DataView(file.buffer);
  view.setUint32(4, file.length - 8, true);
  view.setUint32(dataOffset - 4, file.length - dataOffset, true);
  return file;
}

function offerDownload(bytes, format) {
  const link = byId("download");
  if (downloadUrl !== null) URL.revokeObjectURL(downloadUrl);
  downloadUrl = bytes === null ? null : URL.createObjectURL(new Blob([bytes], { type: `audio/${format}` }));
  link.hidden = downloadUrl === null;
  if (downloadUrl === null) {
    link.removeAttribute("href");
    return;
  }
  link.href = downloadUrl;
  link.download = `speech.${format}`;
  link.textContent = `Download speech.${format} (${bytes.length.toLocaleString()} bytes)`;
}

function resetStats() {
  for (const id of ["ttfa", "rtf", "duration", "received", "playback"]) byId(id).textContent = "–";
  byId("received").dataset.bytes = "0";
  byId("playback").dataset.scheduledSamples = "0";
  waveform.reset();
}

function stop() {
  if (typing !== null) {
    const session = typing;
    typing = null;
    session.socket.close(); // the server cancels the stream's decode
    session.player.stop();
  }
  if (current === null) return;
  current.controller.abort();
  current.player.stop();
  current = null;
  byId("stop").disabled = true;
}

async function speak(event) {
  event.preventDefault();
  if (byId("speak-as-i-type").checked) {
    onTyped(); // what is not sent yet, then the end
    return endTyping();
  }
  stop(); // a new request replaces the one playing
  showError("");
  resetStats();
  offerDownload(null, "");
  const format = byId("format").value;
  const controller = new AbortController();
  const player = new Player(); // created inside the click, so that the browser lets it play
  current = { controller, player };
  const isCurrent = () => current?.controller === controller;
  byId("stop").disabled = false;
  const streaming = byId("stream").checked;
  setStatus("requesting", "synthesizing…");

  const started = performance.now();
  const decoder = new SampleDecoder(format, serverInfo.sample_rate);
  const pieces = [];
  let byteCount = 0;
  let sampleCount = 0;
  try {
    const response = await api("v1/tts", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(requestBody(format)),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await apiErrorMessage(response));
    const reader = response.body.getReader();
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (error) {
        if (error.name === "AbortError") throw error;
        throw new Error(`the stream broke off after ${byteCount} bytes: ${error.message}`);
      }
      if (chunk.done) break;
      pieces.push(chunk.value);
      byteCount += chunk.value.length;
      byId("received").dataset.bytes = String(byteCount);
      byId("received").textContent = `${byteCount.toLocaleString()} bytes`;
      if (!PIECEWISE_FORMATS.includes(format)) continue; // decoded once the whole file is in
      const samples = decoder.push(chunk.value);
      if (samples.length > 0 && sampleCount === 0) {
        byId("ttfa").textContent = `${Math.round(performance.now() - started)} ms`;
        setStatus("streaming", streaming ? "playing while synthesizing…" : "playing…");
      }
      sampleCount += samples.length;
      player.push(samples, decoder.sampleRate);
      waveform.push(samples);
      byId("duration").textContent = `${(sampleCount / decoder.sampleRate).toFixed(2)} s`;
      showPlayback(player);
    }
    if (!PIECEWISE_FORMATS.includes(format)) {
      const decoded = await decodeFile(concatBytes(pieces), format);
      decoder.sampleRate = decoded.sampleRate;
      const samples = decoded.getChannelData(0);
      byId("ttfa").textContent = `${Math.round(performance.now() - started)} ms`;
      setStatus("streaming", "playing…");
      sampleCount = samples.length;
      player.push(samples, decoded.sampleRate);
      waveform.push(samples);
      byId("duration").textContent = `${(sampleCount / decoded.sampleRate).toFixed(2)} s`;
    }
    player.flush(decoder.sampleRate);
    waveform.finish();
    showPlayback(player);
    if (sampleCount === 0) throw new Error("the server sent no audio");
    // Real-time factor: seconds spent on the request per second of audio (below 1: faster than real time).
    const audioSeconds = sampleCount / decoder.sampleRate;
    const requestSeconds = (performance.now() - started) / 1000;
    byId("rtf").textContent = `${(requestSeconds / audioSeconds).toFixed(3)} (${requestSeconds.toFixed(2)} s for ${audioSeconds.toFixed(2)} s of audio)`;
    offerDownload(downloadableBytes(concatBytes(pieces), format, decoder.dataOffset), format);
    setStatus("done");
  } catch (error) {
    if (!isCurrent()) return; // replaced by a newer request, or stopped
    showError(error.message);
    setStatus("error");
  }
}

// A whole mp3, opus, aac or flac file -> an AudioBuffer at the file's rate, decoded by the browser.
async function decodeFile(bytes, format) {
  const context = new OfflineAudioContext(1, 1, serverInfo.sample_rate);
  try {
    return await context.decodeAudioData(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length));
  } catch (error) {
    throw new Error(`this browser cannot decode ${format}; the file can still be downloaded (${error.message})`);
  }
}

// --- speak as I type: the text stream WebSocket ---------------------------------------------------------

const STREAM_PROTOCOL = "cosyvoice-tts"; // serve_app/guard.py WEBSOCKET_PROTOCOL
const STREAM_KEY_PROTOCOL = "cosyvoice-tts.bearer."; // WEBSOCKET_KEY_PROTOCOL_PREFIX: a WebSocket sends no headers
const STREAM_SAMPLE_RATE = 24000; // the stream speaks OpenAI's protocol, at OpenAI's rate
let typing = null; // the open text stream: {socket, send, player, decoder, pieces, bytes, samples, started}
let typedSent = ""; // the text sent so far: typing on sends only what is added to it

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  return btoa(String.fromCharCode(...bytes)).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

function openTypingStream() {
  stop(); // a request playing
  showError("");
  resetStats();
  offerDownload(null, "");
  const url = new URL("v1/audio/speech/stream", location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  const protocols = [STREAM_PROTOCOL, ...(apiKey() === "" ? [] : [STREAM_KEY_PROTOCOL + base64url(apiKey())])];
  const socket = new WebSocket(url, protocols);
  socket.binaryType = "arraybuffer";
  const queued = [];
  const session = {
    socket,
    player: new Player(), // created inside a key press, so that the browser lets it play
    decoder: new SampleDecoder("pcm", STREAM_SAMPLE_RATE),
    pieces: [],
    bytes: 0,
    samples: 0,
    started: performance.now(),
    send: (message) => (socket.readyState === WebSocket.OPEN ? socket.send(JSON.stringify(message)) : queued.push(message)),
  };
  const start = { type: "start", model: serverInfo.model, voice: byId("voice").value, response_format: "pcm" };
  start.speed = Number(byId("speed").value);
  if (byId("mode").value === "instruct") start.instructions = byId("instruct").value;
  socket.addEventListener("open", () => {
    socket.send(JSON.stringify(start));
    queued.splice(0).forEach((message) => socket.send(JSON.stringify(message)));
  });
  socket.addEventListener("message", (event) => onStreamMessage(session, event.data));
  socket.addEventListener("close", () => {
    if (typing !== session) return;
    typing = null;
    byId("stop").disabled = true;
    if (!["done", "error"].includes(byId("status").dataset.state)) {
      showError("the text stream closed before its end");
      setStatus("error");
    }
  });
  typing = session;
  byId("stop").disabled = false;
  setStatus("listening", "speaking as you type…");
}

function onStreamMessage(session, data) {
  if (typing !== session) return;
  if (typeof data !== "string") {
    const piece = new Uint8Array(data);
    session.pieces.push(piece);
    session.bytes += piece.length;
    byId("received").dataset.bytes = String(session.bytes);
    byId("received").textContent = `${session.bytes.toLocaleString()} bytes`;
    const samples = session.decoder.push(piece);
    if (samples.length > 0 && session.samples === 0) {
      byId("ttfa").textContent = `${Math.round(performance.now() - session.started)} ms`;
      setStatus("streaming", "playing as you type…");
    }
    session.samples += samples.length;
    session.player.push(samples, STREAM_SAMPLE_RATE);
    waveform.push(samples);
    byId("duration").textContent = `${(session.samples / STREAM_SAMPLE_RATE).toFixed(2)} s`;
    showPlayback(session.player);
    return;
  }
  const event = JSON.parse(data);
  if (event.type === "error") {
    typing = null;
    session.player.stop();
    byId("stop").disabled = true;
    if (event.error.code === "StreamIdleError") return setStatus("ready"); // a pause in typing: the next key reopens
    showError(event.error.message);
    setStatus("error");
  } else if (event.type === "speech.audio.done") {
    typing = null;
    byId("stop").disabled = true;
    session.player.flush(STREAM_SAMPLE_RATE);
    waveform.finish();
    showPlayback(session.player);
    offerDownload(concatBytes(session.pieces), "pcm");
    setStatus("done");
  }
}

// Each input sends what was added to the text since the last one (an edit before it cannot be taken back).
function onTyped() {
  if (!byId("speak-as-i-type").checked || serverInfo === null) return;
  const text = byId("text").value;
  if (!text.startsWith(typedSent)) {
    typedSent = text;
    return;
  }
  const delta = text.slice(typedSent.length);
  if (delta === "") return;
  if (typing === null) openTypingStream();
  typedSent = text;
  typing.send({ type: "text", text: delta });
}

// Speak the rest and end the stream.
function endTyping() {
  if (typing === null) return;
  typing.send({ type: "end" });
  setStatus(byId("status").dataset.state === "streaming" ? "streaming" : "listening", "speaking the rest…");
}

function toggleTyping() {
  const on = byId("speak-as-i-type").checked;
  byId("typing-hint").hidden = !on;
  if (on) typedSent = ""; // the text already there is spoken with the first key
  else endTyping();
}

// --- voices: upload or record, register, delete ------------------------------------------------------

let recorded = null; // a WAV Blob of the last microphone recording
let recorder = null;

// A 16-bit mono WAV file of float samples: what the server reads (browsers record webm/ogg, which it does not).
function wavFile(samples, sampleRate) {
  const header = new ArrayBuffer(44);
  const view = new DataView(header);
  const text = (offset, value) => [...value].forEach((char, i) => view.setUint8(offset + i, char.charCodeAt(0)));
  const dataBytes = samples.length * BYTES_PER_SAMPLE;
  text(0, "RIFF");
  view.setUint32(4, 36 + dataBytes, true);
  text(8, "WAVEfmt ");
  view.setUint32(16, 16, true);
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, sampleRate, true);
  view.setUint32(28, sampleRate * BYTES_PER_SAMPLE, true);
  view.setUint16(32, BYTES_PER_SAMPLE, true);
  view.setUint16(34, 16, true);
  text(36, "data");
  view.setUint32(40, dataBytes, true);
  const data = new DataView(new ArrayBuffer(dataBytes));
  samples.forEach((sample, i) => data.setInt16(i * BYTES_PER_SAMPLE, Math.max(-1, Math.min(1, sample)) * 32767, true));
  return new Blob([header, data.buffer], { type: "audio/wav" });
}

function setRecordingState(state, text) {
  const label = byId("recording-state");
  label.dataset.state = state;
  label.textContent = text;
}

async function startRecording() {
  showError("", byId("voice-error"));
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const parts = [];
    recorder = new MediaRecorder(stream);
    recorder.addEventListener("dataavailable", (event) => parts.push(event.data));
    recorder.addEventListener("stop", async () => {
      stream.getTracks().forEach((track) => track.stop());
      try {
        const context = new OfflineAudioContext(1, 1, 48000);
        const audio = await context.decodeAudioData(await new Blob(parts).arrayBuffer());
        recorded = wavFile(audio.getChannelData(0), audio.sampleRate);
        byId("voice-file").value = ""; // the recording replaces a chosen file
        setRecordingState("recorded", `recorded ${audio.duration.toFixed(1)} s`);
      } catch (error) {
        setRecordingState("none", "no recording");
        showError(`could not read the recording: ${error.message}`, byId("voice-error"));
      }
    });
    recorder.start();
    byId("record").disabled = true;
    byId("stop-recording").disabled = false;
    setRecordingState("recording", "recording…");
  } catch (error) {
    showError(`cannot record from the microphone: ${error.message}`, byId("voice-error"));
  }
}

function stopRecording() {
  recorder?.stop();
  recorder = null;
  byId("record").disabled = false;
  byId("stop-recording").disabled = true;
}

async function registerVoice() {
  const box = byId("voice-error");
  showError("", box);
  const file = byId("voice-file").files[0] ?? null;
  const audio = file ?? recorded;
  if (audio === null) return showError("choose a file or record one first", box);
  const form = new FormData();
  form.append("file", audio, file?.name ?? "recording.wav");
  form.append("transcript", byId("transcript").value);
  if (byId("voice-name").value.trim()) form.append("name", byId("voice-name").value.trim());
  byId("register").disabled = true;
  try {
    const response = await api("v1/voices", { method: "POST", body: form });
    if (!response.ok) throw new Error(await apiErrorMessage(response));
    const voice = await response.json();
    await loadVoices();
    byId("voice").value = voice.id; // speak with the new voice next
    updateModeHint();
    byId("voice-file").value = "";
    recorded = null;
    setRecordingState("none", "no recording");
  } catch (error) {
    showError(error.message, box);
  } finally {
    byId("register").disabled = !serverInfo?.voice_cloning;
  }
}

async function deleteVoice(voiceId) {
  const box = byId("voice-error");
  showError("", box);
  try {
    const response = await api(`v1/voices/${encodeURIComponent(voiceId)}`, { method: "DELETE" });
    if (!response.ok) throw new Error(await apiErrorMessage(response));
    await loadVoices();
  } catch (error) {
    showError(error.message, box);
  }
}

// --- wiring ------------------------------------------------------------------------------------------

byId("api-key").value = apiKey();
byId("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY_STORAGE, byId("api-key").value.trim());
  loadVoices();
});
byId("speak-form").addEventListener("submit", speak);
byId("stop").addEventListener("click", () => {
  stop();
  setStatus("stopped");
});
byId("stream").addEventListener("change", () => serverInfo && fillFormats());
byId("speak-as-i-type").addEventListener("change", toggleTyping);
byId("text").addEventListener("input", onTyped);
byId("mode").addEventListener("change", updateModeHint);
byId("voice").addEventListener("change", updateModeHint);
byId("open-voices").addEventListener("click", () => byId("voice-dialog").showModal());
byId("close-voices").addEventListener("click", () => byId("voice-dialog").close());
byId("record").addEventListener("click", startRecording);
byId("stop-recording").addEventListener("click", stopRecording);
byId("register").addEventListener("click", registerVoice);
byId("voice-file").addEventListener("change", () => {
  recorded = null; // a chosen file replaces a recording
  setRecordingState("none", "no recording");
});
loadVoices();
