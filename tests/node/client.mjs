// A gateway's loop in Node.js against a running worker: Info, Prefill (a sequence created with its prompt, the first
// token sampled), three Decodes (each feeding back the token just sampled), three more over one Steps channel and a
// step on an unknown sequence (answered with its error, the channel open), Release. Prints one JSON line with what
// it got. Usage: node client.mjs ADDRESS PROTO_FILE INCLUDE_DIR SEQ_ID TOKEN,TOKEN,...
// (INCLUDE_DIR: where google/rpc/status.proto is, which worker.proto imports.)
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const [address, protoFile, includeDir, seqId, prompt] = process.argv.slice(2);
const definition = protoLoader.loadSync(protoFile, {
  keepCase: true, longs: String, enums: String, defaults: true, includeDirs: [includeDir],
});
const { Worker } = grpc.loadPackageDefinition(definition).metrale.v1;
const client = new Worker(address, grpc.credentials.createInsecure());

function call(method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + 30000 }, (error, reply) => (error ? reject(error) : resolve(reply)));
  });
}

try {
  const info = await call("Info", {});
  const tokens = [];
  let reply = await call("Prefill", {
    slices: [{ seq_id: seqId, tokens: prompt.split(",").map(Number), chunk_start: 0, is_last_chunk: true }],
  });
  tokens.push(reply.tokens[0]);
  for (let i = 0; i < 3; i++) {
    reply = await call("Decode", { seq_ids: [seqId], tokens: [tokens[tokens.length - 1]] });
    tokens.push(reply.tokens[0]);
  }
  const steps = client.Steps({ deadline: Date.now() + 30000 });
  const answers = [];
  steps.on("data", (answer) => answers.push(answer));
  const ended = new Promise((resolve, reject) => { steps.on("end", resolve); steps.on("error", reject); });
  for (let i = 0; i < 3; i++) {
    const answered = answers.length;
    steps.write({ step_id: String(100 + i), decode: { seq_ids: [seqId], tokens: [tokens[tokens.length - 1]] } });
    while (answers.length === answered) await new Promise((resolve) => steps.once("data", resolve));
    tokens.push(answers[answers.length - 1].result.tokens[0]);
  }
  steps.write({ step_id: "200", decode: { seq_ids: ["999999"], tokens: [1] } });
  steps.end();
  await ended;
  const failed = answers[answers.length - 1];
  const released = await call("Release", { seq_ids: [seqId] });
  console.log(JSON.stringify({
    vocab_size: info.vocab_size, architecture: info.architecture, tokens, released: released.released_seq_ids,
    step_ids: answers.map((a) => a.step_id), error_code: failed.error ? failed.error.code : null,
  }));
} catch (error) {
  console.error(`${error.code} ${error.details}`);
  process.exitCode = 1;
} finally {
  client.close();
}
