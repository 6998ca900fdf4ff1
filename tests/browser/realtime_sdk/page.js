// The official Realtime agents SDK, as an app would use it: a RealtimeSession over its WebRTC transport, pointed
// at rtc-agent's base URL with an ephemeral key. The test reads window.sdk.
import { OpenAIRealtimeWebRTC, RealtimeAgent, RealtimeSession } from '@openai/agents-realtime';

const sdk = (window.sdk = { events: [], errors: [], callId: null, connected: false, rtpSteps: [] });

async function rtpSteps(pc) {
  // The agent's RTP timestamps as Chromium receives them: successive values differ by 3840 for an 80 ms packet.
  const [receiver] = pc.getReceivers().filter((r) => r.track.kind === 'audio');
  let last = null;
  setInterval(() => {
    const [source] = receiver.getSynchronizationSources();
    if (source && source.rtpTimestamp !== last) {
      if (last !== null) sdk.rtpSteps.push((source.rtpTimestamp - last) >>> 0);
      last = source.rtpTimestamp;
    }
  }, 5);
}

window.inboundAudio = async () => {
  const stats = await sdk.transport.connectionState.peerConnection.getStats();
  for (const s of stats.values()) {
    if (s.type === 'inbound-rtp' && s.kind === 'audio') {
      return { packets: s.packetsReceived, energy: s.totalAudioEnergy, duration: s.totalSamplesDuration };
    }
  }
  return null;
};

window.startCall = async ({ baseUrl, key }) => {
  const audioElement = document.createElement('audio');
  audioElement.autoplay = true;
  document.body.append(audioElement);
  const transport = (sdk.transport = new OpenAIRealtimeWebRTC({ baseUrl: `${baseUrl}/v1/realtime/calls`, audioElement }));
  const agent = new RealtimeAgent({ name: 'Assistant', instructions: 'Answer in one short sentence.' });
  const session = new RealtimeSession(agent, {
    transport,
    model: 'tiny',
    config: {
      audio: {
        input: { transcription: null, turnDetection: { type: 'server_vad', silenceDurationMs: 400 } },
        output: { voice: 'chelsie' },
      },
    },
  });
  session.on('transport_event', (event) => sdk.events.push(event));
  session.on('error', (e) => sdk.errors.push(String(e?.error?.error?.message ?? e?.error?.message ?? e?.error ?? e)));
  await session.connect({ apiKey: key });
  sdk.connected = true;
  sdk.callId = transport.callId;
  rtpSteps(transport.connectionState.peerConnection);
};
