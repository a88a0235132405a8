// Sluice's public text-level API (package sluice.v1), loaded from the .proto files
// alone, as any Node.js client would; shared by the scripts in this folder.
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const protoRoot = path.resolve(__dirname, "..", "..", "proto");
const def = protoLoader.loadSync(path.join(protoRoot, "sluice/v1/generation.proto"), {
  includeDirs: [protoRoot], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true,
});

module.exports = { grpc, sluice: grpc.loadPackageDefinition(def).sluice.v1 };
