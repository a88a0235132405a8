// A Node.js client of Sluice's public text-level API (sluice.v1.Generation), written
// against the .proto files only: it starts every request of a JSON list on one
// GenerateStream, half-closes, and prints a JSON summary per request id.
//   node generate_stream.js ADDR '[{"text": "...", "stopping": {...}}, ...]'
"use strict";
const { grpc, sluice } = require("./sluice");

const [addr, body] = process.argv.slice(2);
const client = new sluice.Generation(addr, grpc.credentials.createInsecure());
const call = client.GenerateStream(new grpc.Metadata(), { deadline: Date.now() + 120000 });
const requests = {};
let messages = 0;
let items = 0;
JSON.parse(body).forEach((request, i) => {
  requests[i + 1] = { text: "", finish_reason: null, usage: null, status_code: null, status_message: "", items: 0 };
  call.write({ id: i + 1, generate: request });
});
call.end();
call.on("data", (msg) => {
  messages += 1;
  for (const item of msg.items) {
    items += 1;
    const r = requests[item.id];
    r.items += 1;
    if (item.response) {
      r.text += item.response.text;
      r.usage = item.response.usage;
      if (item.response.finish_reason !== "FINISH_REASON_UNSPECIFIED") r.finish_reason = item.response.finish_reason;
    }
    if (item.end) {
      r.status_code = item.status_code;
      r.status_message = item.status_message;
    }
  }
});
call.on("error", (err) => {
  console.log(JSON.stringify({ error: { code: err.code, details: err.details } }));
  process.exit(0);
});
call.on("end", () => {
  console.log(JSON.stringify({ requests, messages, items }));
  client.close();
});
