#!/usr/bin/env bash
# Moves real weights (and other large inputs) to the device machine, one call at a time.
#
# The device tool carries at most 64 MiB per call (working tree included), so large files
# travel as chunks. Two halves:
#
#   here:   bash benchmarks/device_stage.sh prepare NAME=FILE_OR_DIR [NAME=...]
#           splits each input into .stage/NAME.partNN chunks of at most CHUNK_BYTES and
#           writes .stage/manifest.txt (name, number of parts, sha256 of the whole).
#           A directory input travels as a tar file. Carry .stage/manifest.txt and one
#           chunk per call.
#   there:  bash benchmarks/device_stage.sh collect
#           copies the carried chunks to $STAGE (/tmp survives while the machine is warm),
#           and once all parts of an input are there, joins them, checks the sha256, and
#           installs it: MODEL.gguf files into $SPECJAX_CACHE/gguf, NAME.tar files
#           unpacked into $STAGE/NAME (their cache/ folder merged into $SPECJAX_CACHE,
#           .gz files in them decompressed).
#           Each installed MODEL.gguf is converted once in the background, so later jobs
#           find the converted model; $STAGE/MODEL.gguf.ready (or NAME.tar.ready) marks
#           an input that is ready. A hash mismatch writes $STAGE/NAME.failed and stops.
set -euo pipefail
STAGE=${STAGE:-/tmp/stage}
CHUNK_BYTES=${CHUNK_BYTES:-59400000}

prepare() {
  mkdir -p .stage
  : > .stage/manifest.txt
  for spec in "$@"; do
    local name=${spec%%=*} src=${spec#*=} file
    if [ -d "$src" ]; then
      file=$(mktemp -d)/$name.tar
      tar cf "$file" -C "$src" .
      name=$name.tar
    else
      file=$src
    fi
    local size parts
    size=$(stat -c %s "$file")
    parts=$(( (size + CHUNK_BYTES - 1) / CHUNK_BYTES ))
    rm -f ".stage/$name".part*
    split -n "$parts" -d -a 2 "$file" ".stage/$name.part"
    echo "$name $parts $(sha256sum "$file" | cut -d' ' -f1)" >> .stage/manifest.txt
  done
  cat .stage/manifest.txt
  ls -l .stage/*.part* | awk '{print $5, $9}'
}

convert() {  # model name: converted once, in the background; then $STAGE/NAME.gguf.ready
  echo "$1.gguf: sha256 ok, converting"
  JAX_PLATFORMS=cpu setsid nohup bash -c "python3 -c \"from models import zoo; zoo.load_model('$1')\" \
    > $STAGE/$1.convert.log 2>&1 && touch $STAGE/$1.gguf.ready" > /dev/null 2>&1 &
}

collect() {
  local cache=${SPECJAX_CACHE:?set SPECJAX_CACHE}
  mkdir -p "$STAGE" "$cache/gguf"
  cp .stage/manifest.txt "$STAGE/" 2>/dev/null || true
  for p in .stage/*.part*; do [ -e "$p" ] && cp "$p" "$STAGE/"; done
  while read -r name parts sha; do
    [ -e "$STAGE/$name.ready" ] || [ -e "$STAGE/$name.joined" ] && continue
    local have
    have=$(find "$STAGE" -maxdepth 1 -name "$name.part*" | wc -l)
    if [ "$have" -lt "$parts" ]; then echo "$name: $have/$parts parts"; continue; fi
    cat "$STAGE/$name".part* > "$STAGE/$name"
    if [ "$(sha256sum "$STAGE/$name" | cut -d' ' -f1)" != "$sha" ]; then
      echo "$name: sha256 mismatch" | tee "$STAGE/$name.failed"; exit 1
    fi
    rm -f "$STAGE/$name".part*
    touch "$STAGE/$name.joined"
    case $name in
      *.gguf)
        mv "$STAGE/$name" "$cache/gguf/$name"
        convert "${name%.gguf}" ;;
      *.tar)  # laid out as $STAGE/NAME/{cache/...,...}; cache/ merges into SPECJAX_CACHE
        mkdir -p "$STAGE/${name%.tar}"
        tar xf "$STAGE/$name" -C "$STAGE/${name%.tar}" && rm "$STAGE/$name"
        find "$STAGE/${name%.tar}" -name '*.gz' -exec gunzip -f {} +
        if [ -d "$STAGE/${name%.tar}/cache" ]; then
          cp -r "$STAGE/${name%.tar}/cache/." "$cache/"
          for g in "$STAGE/${name%.tar}"/cache/gguf/*.gguf; do
            [ -e "$g" ] && convert "$(basename "${g%.gguf}")"
          done
        fi
        touch "$STAGE/$name.ready"; echo "$name: unpacked" ;;
    esac
  done < "$STAGE/manifest.txt"
}

cmd=${1:?usage: device_stage.sh prepare NAME=PATH... | collect}
shift
"$cmd" "$@"
