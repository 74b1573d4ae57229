variable "project" {
  description = "Google Cloud project that holds the endpoint, the model bucket and the service account."
  type        = string
}

variable "region" {
  description = "Vertex AI region, also the location of the model bucket (for example us-central1)."
  type        = string
}

variable "name" {
  description = "Name of the model, the endpoint and the resources around them."
  type        = string
  default     = "ferry"
}

variable "image_uri" {
  description = "ferry's image in Artifact Registry (vertex/deploy.sh pushes one), for example us-central1-docker.pkg.dev/PROJECT/ferry/ferry:TAG."
  type        = string
}

variable "model_bucket" {
  description = "Name of the bucket created for the Triton model repository."
  type        = string
}

variable "model_prefix" {
  description = "Folder of the model repository inside the bucket; Vertex passes it to ferry as AIP_STORAGE_URI."
  type        = string
  default     = "model_repository"
}

variable "machine_type" {
  description = "Machine type of each replica."
  type        = string
  default     = "n1-standard-4"
}

variable "accelerator_type" {
  description = "GPU type per replica (for example NVIDIA_TESLA_T4); empty for CPU only."
  type        = string
  default     = ""
}

variable "accelerator_count" {
  description = "GPUs per replica when accelerator_type is set."
  type        = number
  default     = 1
}

variable "min_replicas" {
  description = "Fewest replicas the endpoint keeps."
  type        = number
  default     = 1
}

variable "max_replicas" {
  description = "Most replicas Vertex AI scales out to."
  type        = number
  default     = 3
}

variable "target_utilization" {
  description = "CPU utilization (or GPU duty cycle with a GPU), in percent, that autoscaling keeps replicas at."
  type        = number
  default     = 60
}

variable "default_model" {
  description = "Model of the repository that predict requests go to when it holds several (FERRY_VERTEX_AI_DEFAULT_MODEL)."
  type        = string
  default     = ""
}

variable "grpc_port" {
  description = "Serve KServe v2 gRPC through Vertex AI on this container port (the model's grpcPorts; needs a dedicated endpoint, which this then creates). 0 = HTTP only."
  type        = number
  default     = 0
}
