// llama_tokenize.mjs - what llama.cpp v0.4.0's llama-tokenize prints by default, through
// node-llama-cpp (whose tokenize adds no special tokens): tools/tokenize/tokenize.cpp calls
// common_tokenize(vocab, prompt, add_bos, parse_special) with add_bos =
// llama_vocab_get_add_bos(vocab) passed as add_special, so llama_tokenize puts the BOS id first
// when the vocabulary adds it and the EOS id last when it adds that too. node-llama-cpp's
// tokens.bos / eos hide an id whose token is not CONTROL (null): bosId / eosId then give it (a
// gpt2 vocabulary without tokenizer.ggml.bos_token_id: llama.cpp's default, 11).
export function llamaTokenizeDefault(model, text, parseSpecial, bosId = null, eosId = null) {
  const ids = Array.from(model.tokenize(text, parseSpecial));
  if (!model._model.shouldPrependBosToken())
    return ids;
  const bos = model.tokens.bos ?? bosId, eos = model.tokens.eos ?? eosId;
  if (bos == null)
    throw new Error("llamaTokenizeDefault: the vocabulary adds a BOS that node-llama-cpp hides: pass bosId");
  const out = [bos, ...ids];
  if (model._model.shouldAppendEosToken()) {
    if (eos == null)
      throw new Error("llamaTokenizeDefault: the vocabulary adds an EOS that node-llama-cpp hides: pass eosId");
    out.push(eos);
  }
  return out;
}
