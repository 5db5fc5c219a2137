"use strict";
// The demo page: streams POST v1/tts and plays each piece of audio as it arrives, with the Web Audio API.
// URLs are relative so that the page also works under a route prefix ending in "/".

const STREAMABLE_FORMATS = ["wav", "pcm"]; // the formats /v1/tts can stream (serve_app/audio.py)
const BYTES_PER_SAMPLE = 2; // the stream is 16-bit little-endian mono
const PCM_SCALE = 32768;
// Network pieces can be a few hundred bytes: merging them means fewer buffer edges to schedule.
const MIN_BLOCK_SAMPLES = 2048;
// Slack for the first block, so that it is not scheduled in the past while the main thread is busy.
const START_LEAD_S = 0.05;

const byId = (id) => document.getElementById(id);
let pcmSampleRate = 0; // from /v1/voices; a WAV stream carries its own
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

// --- the page ----------------------------------------------------------------------------------------

function showError(message) {
  const box = byId("error");
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

function fillSelect(select, values, labels = {}) {
  select.replaceChildren(
    ...values.map((value) => {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = labels[value] ?? value;
      return option;
    }),
  );
}

async function loadVoices() {
  try {
    const response = await fetch("v1/voices");
    if (!response.ok) throw new Error(await apiErrorMessage(response));
    const info = await response.json();
    pcmSampleRate = info.sample_rate;
    fillSelect(byId("voice"), info.voices);
    const formats = STREAMABLE_FORMATS.filter((name) => info.formats.includes(name));
    fillSelect(byId("format"), formats, { wav: "wav", pcm: "pcm (raw 16-bit mono)" });
    byId("voice").disabled = false;
    byId("speak").disabled = false;
    setStatus("ready");
  } catch (error) {
    showError(`could not load the voices: ${error.message}`);
    setStatus("error");
  }
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
}

function stop() {
  if (current === null) return;
  current.controller.abort();
  current.player.stop();
  current = null;
  byId("stop").disabled = true;
}

async function speak(event) {
  event.preventDefault();
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
  setStatus("requesting", "synthesizing…");

  const started = performance.now();
  const decoder = new SampleDecoder(format, pcmSampleRate);
  const pieces = [];
  let byteCount = 0;
  let sampleCount = 0;
  try {
    const response = await fetch("v1/tts", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ text: byId("text").value, voice: byId("voice").value, format, stream: true }),
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
      const samples = decoder.push(chunk.value);
      if (samples.length > 0 && sampleCount === 0) {
        byId("ttfa").textContent = `${Math.round(performance.now() - started)} ms`;
        setStatus("streaming", "playing while synthesizing…");
      }
      sampleCount += samples.length;
      player.push(samples, decoder.sampleRate);
      byId("received").dataset.bytes = String(byteCount);
      byId("received").textContent = `${byteCount.toLocaleString()} bytes`;
      byId("duration").textContent = `${(sampleCount / decoder.sampleRate).toFixed(2)} s`;
      showPlayback(player);
    }
    player.flush(decoder.sampleRate);
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

byId("speak-form").addEventListener("submit", speak);
byId("stop").addEventListener("click", () => {
  stop();
  setStatus("stopped");
});
loadVoices();
