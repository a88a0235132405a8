// A Node.js client of Sluice's public text-level API (sluice.v1.Generation), written
// against the .proto files only: it streams one Generate call and prints a JSON summary.
//   node generate.js ADDR '{"chat": {"messages": [...]}, "sampling": {...}, "stopping": {...}}' [API_KEY]
"use strict";
const { grpc, sluice } = require("./sluice");

const [addr, body, apiKey] = process.argv.slice(2);
const client = new sluice.Generation(addr, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
if (apiKey) metadata.set("authorization", `Bearer ${apiKey}`);
const call = client.Generate(JSON.parse(body), metadata, { deadline: Date.now() + 120000 });
const texts = {};
let finish = null;
let usage = null;
let messages = 0;
const toolCalls = []; // sequence 0's calls, reassembled from their deltas
call.on("data", (msg) => {
  messages += 1;
  texts[msg.index] = (texts[msg.index] || "") + msg.text;
  for (const d of msg.index === 0 ? msg.tool_calls : []) {
    if (d.index === toolCalls.length) toolCalls.push({ id: d.id, name: d.name, arguments: d.arguments });
    else toolCalls[d.index].arguments += d.arguments;
  }
  usage = msg.usage;
  if (msg.finish_reason !== "FINISH_REASON_UNSPECIFIED") finish = msg.finish_reason;
});
call.on("error", (err) => {
  console.log(JSON.stringify({ error: { code: err.code, details: err.details } }));
  process.exit(0);
});
call.on("end", () => {
  console.log(JSON.stringify({ text: texts[0] || "", finish_reason: finish, usage, messages, tool_calls: toolCalls }));
  client.close();
});
