{{- define "lmcache-p2p.config.prefiller" -}}
prefiller.yaml: |
  chunk_size: 256
  local_cpu: false
  max_local_cpu_size: 2
  enable_pd: false
  save_unfull_chunk: true
  storage_plugins:
  - p2p
  extra_config:
    storage_plugin.p2p.module_path: lmcache_p2p.backend
    storage_plugin.p2p.class_name: SenderBackend
    p2p:
      role: sender
      transport: nixl
      connect_timeout_s: 5
      alloc_timeout_s: 10
      transfer_timeout_s: 30
      instance_id: ${POD_NAME}
      http_url: http://${POD_IP}:7100
      proxy_url: tcp://{{ .Release.Name }}-proxy:9101
      shared_secret: ${LMCACHE_P2P_SECRET}
      host: ${POD_IP}
      buffer_size: 2GB
      buffer_device: cuda
logging.json: |-
  {
    "version": 1,
    "disable_existing_loggers": false,
    "formatters": {
      "vllm": {
        "()": "vllm.logging_utils.NewLineFormatter",
        "fmt": "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s",
        "datefmt": "%m-%d %H:%M:%S"
      }
    },
    "handlers": {
      "vllm": {
        "class": "logging.StreamHandler",
        "formatter": "vllm",
        "level": "INFO",
        "stream": "ext://sys.stdout"
      }
    },
    "loggers": {
      "vllm": {
        "handlers": [
          "vllm"
        ],
        "level": "INFO",
        "propagate": false
      },
      "lmcache_p2p": {
        "handlers": [
          "vllm"
        ],
        "level": "INFO",
        "propagate": false
      }
    }
  }
{{- end }}

{{- define "lmcache-p2p.config.decoder" -}}
decoder.yaml: |
  chunk_size: 256
  local_cpu: false
  max_local_cpu_size: 1
  enable_pd: false
  save_unfull_chunk: true
  storage_plugins:
  - p2p
  extra_config:
    storage_plugin.p2p.module_path: lmcache_p2p.backend
    storage_plugin.p2p.class_name: ReceiverBackend
    p2p:
      role: receiver
      transport: nixl
      buffer_size: 1GB
      buffer_device: cuda
      host: ${POD_IP}
      control_ports: 7300
      transport_ports: 7400
      reserve_lease_s: 60
      ready_lease_s: 120
      instance_id: ${POD_NAME}
      http_url: http://${POD_IP}:7200
      proxy_url: tcp://{{ .Release.Name }}-proxy:9101
      shared_secret: ${LMCACHE_P2P_SECRET}
logging.json: |-
  {
    "version": 1,
    "disable_existing_loggers": false,
    "formatters": {
      "vllm": {
        "()": "vllm.logging_utils.NewLineFormatter",
        "fmt": "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s",
        "datefmt": "%m-%d %H:%M:%S"
      }
    },
    "handlers": {
      "vllm": {
        "class": "logging.StreamHandler",
        "formatter": "vllm",
        "level": "INFO",
        "stream": "ext://sys.stdout"
      }
    },
    "loggers": {
      "vllm": {
        "handlers": [
          "vllm"
        ],
        "level": "INFO",
        "propagate": false
      },
      "lmcache_p2p": {
        "handlers": [
          "vllm"
        ],
        "level": "INFO",
        "propagate": false
      }
    }
  }
{{- end }}
