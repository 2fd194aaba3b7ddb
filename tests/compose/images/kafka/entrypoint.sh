#!/bin/bash
# The official image's convention: every KAFKA_<NAME> variable is the broker property <name>
# (lower case; '_' is '.', '__' is '_', '___' is '-'), except the JVM option variables;
# CLUSTER_ID formats the storage on first start.
set -euo pipefail
config=/var/lib/kafka/server.properties
: > "$config"
for var in $(compgen -e); do
  case "$var" in
    KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_GC_LOG_OPTS|KAFKA_LOG4J_OPTS|KAFKA_JMX_OPTS) continue ;;
    KAFKA_*)
      key=${var#KAFKA_}; key=${key,,}
      key=${key//___/-}; key=${key//__/@}; key=${key//_/.}; key=${key//@/_}
      printf '%s=%s\n' "$key" "${!var}" >> "$config" ;;
  esac
done
java=(java ${KAFKA_HEAP_OPTS:--Xmx512m} -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties -cp '/opt/kafka/libs/*')
"${java[@]}" kafka.tools.StorageTool format --cluster-id="${CLUSTER_ID}" -c "$config" --ignore-formatted > /dev/null
exec "${java[@]}" kafka.Kafka "$config"
